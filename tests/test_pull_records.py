"""Which rows a pending push would update, as a server answers a prefetch's state: the rows a
read handed out and still holds (store/pulls.py), found with or without searching the read's
record."""

from __future__ import annotations

import torch
from torch import Tensor

from paramserver.embedding import DynamicOptions
from paramserver.optim import make_rule
from paramserver.optimconfig import OptimizerConfig
from paramserver.sharding import ShardPlan, TableSpec
from paramserver.store.arena import ROW_HELD
from paramserver.store.dynamic import DynamicTable
from paramserver.store.store import Store
from paramserver.store.table import ReadAsks, Reading


def table(**options: object) -> DynamicTable:
    spec = TableSpec("emb.weight", 0, 4, torch.float32, dynamic=DynamicOptions(**options))  # type: ignore[arg-type]
    return DynamicTable(spec, make_rule(OptimizerConfig(name="adagrad", lr=0.1)))


def ids(*values: int) -> Tensor:
    return torch.tensor(values, dtype=torch.int64)


def taking(t: DynamicTable, asked: Tensor, pull: tuple[int, int]) -> list[bool]:
    return t.rows_taking_update(asked, t.ids.lookup(asked), pull).tolist()


def test_every_row_the_read_handed_out_and_still_holds_takes_the_update() -> None:
    """No row of the read's record lost: each asked id with a row takes it, whether the read
    handed it out or not (the id's current row); an id without a row takes none."""
    t = table()
    t.read(ids(1, 2, 3), Reading(train=True, clock=1, pull=(0, 1)))
    t.read(ids(4), Reading(train=True, clock=1, pull=(1, 1)))
    assert t.pulls.all_rows_kept((0, 1))
    assert taking(t, ids(1, 3), (0, 1)) == [True, True]
    assert taking(t, ids(2, 4, 9), (0, 1)) == [True, True, False]
    assert taking(t, ids(1, 4), (0, 7)) == [True, True]  # no record of that read: rows now


def test_a_row_lost_since_the_read_takes_no_update_even_if_its_id_came_back() -> None:
    """An id evicted and admitted again after the read has a new row: the update, computed
    from the old one, is not applied to it; the read's other rows take theirs."""
    t = table(ttl_steps=2)
    t.read(ids(1, 2), Reading(train=True, clock=1, pull=(0, 1)))
    t.read(ids(2), Reading(train=True, clock=5, pull=(1, 5)))  # 1 expires: struck
    assert int(t.ids.lookup(ids(1))) == -1
    t.read(ids(1), Reading(train=True, clock=6, pull=(1, 6)))  # 1 is back: a new row
    assert not t.pulls.all_rows_kept((0, 1))
    assert taking(t, ids(1, 2), (0, 1)) == [False, True]
    assert taking(t, ids(2, 3), (0, 1)) == [True, False]


def test_an_id_pending_at_the_read_takes_no_update_once_admitted() -> None:
    """An id without a row at the read (not admitted yet) has no gradient row to take."""
    t = table(min_count=2, ttl_steps=100)
    t.read(ids(5), Reading(train=True, clock=1, pull=(0, 1)))
    t.read(ids(5, 6), Reading(train=True, clock=2, pull=(0, 2)))  # 5 admitted, 6 pending
    t.read(ids(6), Reading(train=True, clock=3, pull=(1, 3)))  # 6 admitted
    assert not t.pulls.all_rows_kept((0, 2))
    assert taking(t, ids(5, 6), (0, 2)) == [True, False]


def test_a_record_gives_each_id_its_row_at_the_read_or_its_row_now() -> None:
    """rows_at: the rows a read handed out (-1 where lost since), and the current row (or
    -1) of an id the read did not hand out."""
    t = table(ttl_steps=2)
    t.read(ids(1, 2), Reading(train=True, clock=1, pull=(0, 1)))
    t.read(ids(7), Reading(train=True, clock=1, pull=(1, 1)))
    handed = t.ids.lookup(ids(1, 2))
    seven = int(t.ids.lookup(ids(7)))
    at_read = t.pulls.rows_at(ids(1, 2, 7, 8), (0, 1), t.ids.lookup)
    assert at_read is not None
    assert at_read.tolist() == [*handed.tolist(), seven, -1]
    t.read(ids(2), Reading(train=True, clock=5, pull=(1, 5)))  # 1 and 7 expire
    at_read = t.pulls.rows_at(ids(1, 2, 7), (0, 1), t.ids.lookup)
    assert at_read is not None and at_read.tolist() == [-1, int(handed[1]), -1]


def test_a_read_of_tables_sharing_an_arena_answers_each_ones_state_and_held_rows() -> None:
    """The state of several dynamic tables of one arena is read in one gather: each table's
    rows, state and which take the pending push, as that table alone would answer them; a
    table whose read lost a row since takes its own search, the others none."""
    specs = [
        TableSpec(name, 0, 4, torch.float32, dynamic=DynamicOptions(ttl_steps=2))  # type: ignore[arg-type]
        for name in ("a", "b", "c")
    ]
    rule = OptimizerConfig(name="adagrad", lr=0.5)
    store = Store(
        0, ShardPlan([], specs, num_servers=1), {}, {}, rule, {s.name: rule for s in specs}
    )
    wanted = {"a": ids(1, 2, 3), "b": ids(1, 2), "c": ids(4, 5, 6)}
    store.read(wanted, Reading(train=True, clock=1, pull=(0, 1)))
    store.apply_rows(
        {n: (i, torch.ones(i.numel(), 4)) for n, i in wanted.items()},
        dict.fromkeys(wanted, 0.5),
        clock=1,
    )
    store.read(
        {"a": ids(1, 2, 3), "b": ids(2), "c": ids(4, 5, 6)},
        Reading(train=True, clock=5, pull=(1, 5)),
    )
    store.read({"b": ids(1)}, Reading(train=True, clock=6, pull=(1, 6)))  # b's 1: a new row
    masks = {
        "a": torch.tensor([True, False, True]),
        "b": torch.tensor([True, True]),
        "c": torch.tensor([False, True, True]),
    }
    read = store.read(wanted, Reading(), ReadAsks(state_masks=masks, pending=(0, 1)))
    (state,) = read.state
    assert state.names == ["a", "b", "c"] and state.counts == [2, 2, 2]
    tables = store.tables
    assert not tables["b"].pulls.all_rows_kept((0, 1)) and tables["a"].pulls.all_rows_kept((0, 1))
    expected_held, expected_sums = [], []
    for name in state.names:
        asked = wanted[name][masks[name]]
        rows = tables[name].ids.lookup(asked)
        expected_held.append(tables[name].rows_taking_update(asked, rows, (0, 1)))
        expected_sums.append(tables[name].arena.state_of(rows)["sum"])
    assert torch.equal(state.parts[ROW_HELD], torch.cat(expected_held))
    assert state.parts[ROW_HELD].tolist() == [True, True, False, True, True, True]
    assert torch.equal(state.parts["sum"], torch.cat(expected_sums))
