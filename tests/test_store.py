"""The store (paramserver.store): the one interface to a server's rows and dense values, which
knows no wire. Every change passes its change feed, numbered in order; rows are set with their
state and ids deleted through it; a snapshot records the sequence it covers."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

from paramserver.errors import StoreError
from paramserver.store.snapshot import restore_store, snapshot_store
from paramserver.store.store import Store
from paramserver.store.table import ReadAsks, Reading
from tests.helpers import ids, make_store, train_read

REPO = Path(__file__).resolve().parent.parent


class Recorder:
    """A change observer that keeps every report, in order."""

    def __init__(self, recovers: bool = False) -> None:
        self.recovers = recovers
        self.seen: list[tuple[int, str, str, list[int] | list[str]]] = []

    def rows_written(self, table: str, ids: Tensor, sequence: int) -> None:
        self.seen.append((sequence, "written", table, ids.tolist()))

    def ids_removed(self, table: str, ids: Tensor, sequence: int) -> None:
        self.seen.append((sequence, "removed", table, ids.tolist()))

    def dense_written(self, names: list[str], sequence: int) -> None:  # type: ignore[override]
        self.seen.append((sequence, "dense", "", list(names)))

    def rows_touched(self, table: str, ids: Tensor, sequence: int) -> None:
        self.seen.append((sequence, "touched", table, ids.tolist()))

    def pending_changed(self, table: str, ids: Tensor, sequence: int) -> None:
        self.seen.append((sequence, "pending", table, ids.tolist()))


def test_every_change_is_told_once_in_order_with_its_sequence_number() -> None:
    store = make_store()
    recorder = Recorder()
    store.changes.attach(recorder)
    train_read(store, 1, hashed=ids(5, 7))  # first sightings: nothing made
    train_read(store, 2, hashed=ids(5))  # 5 admitted: its row is made
    store.apply_rows({"fixed": (ids(2, 9), torch.ones(2, 4))}, {"fixed": 0.5}, clock=2)
    store.apply_rows({"hashed": (ids(5, 7), torch.ones(2, 4))}, {"hashed": 0.5}, clock=2)
    store.apply_dense({"w": torch.ones(3)}, lr=0.5)
    train_read(store, 9, hashed=ids(7))  # 5 expires (untouched since 2); 7 admitted
    assert recorder.seen == [
        (1, "written", "hashed", [5]),
        (2, "written", "fixed", [2, 9]),
        (3, "written", "hashed", [5]),  # 7's gradient is dropped: it has no row
        (4, "dense", "", ["w"]),
        (5, "written", "hashed", [7]),
        (6, "removed", "hashed", [5]),
    ]
    assert store.changes.sequence == 6


def test_without_an_observer_changes_are_still_numbered() -> None:
    store = make_store()
    store.apply_rows({"fixed": (ids(1), torch.ones(1, 4))}, {"fixed": 0.5}, clock=1)
    store.apply_dense({"w": torch.ones(3)}, lr=0.5)
    assert store.changes.sequence == 2
    recorder = Recorder()
    store.changes.attach(recorder)
    store.apply_rows({"fixed": (ids(1), torch.ones(1, 4))}, {"fixed": 0.5}, clock=1)
    assert recorder.seen == [(3, "written", "fixed", [1])]


def test_one_update_of_several_tables_is_one_change_told_table_by_table() -> None:
    store = make_store()
    train_read(store, 1, hashed=ids(5))
    train_read(store, 2, hashed=ids(5))  # admitted: change 1
    recorder = Recorder()
    store.changes.attach(recorder)
    grads = {"fixed": (ids(3), torch.ones(1, 4)), "hashed": (ids(5, 6), torch.ones(2, 4))}
    assert store.apply_rows(grads, {"fixed": 0.5, "hashed": 0.5}, clock=2) == 2
    assert recorder.seen == [(2, "written", "fixed", [3]), (2, "written", "hashed", [5])]
    # An update whose every gradient is dropped (6 has no row) changes nothing: no number.
    store.apply_rows({"hashed": (ids(6), torch.ones(1, 4))}, {"hashed": 0.5}, clock=2)
    assert store.changes.sequence == 2 and len(recorder.seen) == 2


def trained_store() -> Store:
    store = make_store()
    train_read(store, 1, hashed=ids(3, 4, 8))
    train_read(store, 1 + 1, hashed=ids(3, 4, 8))
    grads = torch.arange(12.0).view(3, 4)
    store.apply_rows({"hashed": (ids(3, 4, 8), grads)}, {"hashed": 0.5}, clock=2)
    store.apply_rows({"fixed": (ids(0, 5, 6), grads)}, {"fixed": 0.5}, clock=2)
    return store


def test_rows_set_with_their_state_read_as_the_rows_they_came_from() -> None:
    source = trained_store()
    target = make_store()
    for name in ("hashed", "fixed"):
        with source.tables[name].lock:
            entries, _ = source.tables[name].snapshot()
        target.set_rows(name, entries)
    want = source.export_state(with_optimizer=True)
    got = target.export_state(with_optimizer=True)
    for table in ("hashed", "fixed"):
        for key, value in want[table].items():
            assert torch.equal(got[table][key], value), (table, key)
    # The state came too: the same push moves both alike.
    for store in (source, target):
        store.apply_rows({"hashed": (ids(4), torch.ones(1, 4))}, {"hashed": 0.5}, clock=3)
    read = {s: s.read({"hashed": ids(4)}, Reading()).values["hashed"] for s in (source, target)}
    assert torch.equal(read[source], read[target])


def test_deleted_ids_read_as_the_default_and_take_no_update() -> None:
    store = trained_store()
    before = store.read({"hashed": ids(3, 4)}, Reading()).values["hashed"]
    store.delete_ids("hashed", ids(3, 99))  # 99 has no row: ignored
    after = store.read({"hashed": ids(3, 4)}, Reading()).values["hashed"]
    assert torch.equal(after[0], torch.zeros(4)) and torch.equal(after[1], before[1])
    assert store.table_stats()["hashed"]["evicted"] == 1
    assert store.apply_rows({"hashed": (ids(3), torch.ones(1, 4))}, {"hashed": 0.5}, 3) == 0


def test_changes_a_table_cannot_take_are_refused_and_change_nothing() -> None:
    store = make_store(servers=2, server=1)
    before = store.export_state(with_optimizer=True)
    with pytest.raises(StoreError, match="fixed table"):
        store.delete_ids("fixed", ids(1))
    others = {"ids": ids(1, 2), "value": torch.zeros(2, 4), "state.sum": torch.zeros(2, 4)}
    with pytest.raises(StoreError, match="its own rows"):  # row 2 lives on server 0
        store.set_rows("fixed", others)
    with pytest.raises(StoreError, match="no table 'nope'"):
        store.set_rows("nope", others)
    with pytest.raises(StoreError, match="unique"):
        store.set_rows("hashed", {**others, "ids": ids(4, 4)})
    with pytest.raises(StoreError, match="no dense parameter"):
        store.set_dense("nope", torch.zeros(3), {}, torch.zeros(()))
    after = store.export_state(with_optimizer=True)
    for name, entry in before.items():
        for key, value in entry.items():
            assert torch.equal(after[name][key], value), (name, key)
    assert store.changes.sequence == 0


def test_a_snapshot_records_the_sequence_it_covers_and_a_restore_numbers_on_from_it() -> None:
    store = trained_store()
    tensors, meta = snapshot_store(store)
    assert meta["sequence"] == store.changes.sequence > 0
    restored = make_store()
    restore_store(restored, [(tensors, meta)])
    assert restored.changes.sequence == meta["sequence"]
    assert restored.state_hash() == store.state_hash()
    recorder = Recorder()
    restored.changes.attach(recorder)
    restored.apply_dense({"w": torch.ones(3)}, lr=0.5)
    assert recorder.seen == [(meta["sequence"] + 1, "dense", "", ["w"])]


def test_a_read_answers_versions_and_the_state_of_the_rows_asked() -> None:
    store = trained_store()
    asks = ReadAsks(
        state_masks={"fixed": torch.tensor([False, True]), "hashed": torch.tensor([True, False])}
    )
    read = store.read({"fixed": ids(0, 5), "hashed": ids(3, 7)}, Reading(), asks)
    assert set(read.values) == {"fixed", "hashed"} and not read.versions
    state = {read_.names[0]: read_ for read_ in read.state}  # a fixed and a dynamic table
    assert len(read.state) == 2 and all(len(r.names) == 1 for r in read.state)
    for name in ("fixed", "hashed"):
        assert state[name].counts == [1] and state[name].parts["sum"].shape == (1, 4)
    assert float(state["fixed"].parts["sum"].sum()) > 0  # row 5 took a push
    assert float(state["hashed"].parts["sum"].sum()) > 0


def test_the_build_refuses_a_store_module_that_imports_the_wire(tmp_path: Path) -> None:
    """The import contract in pyproject.toml fails the build on such an import (it can fail)."""
    copy = tmp_path / "repo"
    shutil.copytree(
        REPO / "paramserver", copy / "paramserver", ignore=shutil.ignore_patterns("*.so")
    )
    shutil.copy(REPO / "pyproject.toml", copy / "pyproject.toml")
    arena = copy / "paramserver" / "store" / "arena.py"
    arena.write_text(
        arena.read_text() + "\nfrom paramserver.wire.messages import RowBlock  # noqa\n"
    )
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run(
        [str(lint)], cwd=copy, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert result.returncode != 0
    assert "The store knows no wire" in result.stdout and "BROKEN" in result.stdout
    assert "paramserver.store.arena -> paramserver.wire.messages" in result.stdout
