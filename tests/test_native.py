"""paramserver's compiled loops (paramserver.native): bitwise torch's Adagrad, the same id map
as numpy's, and a clear error for bad arguments (how the install builds and loads them, and the
tensors they take: tests/test_native_build.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from paramserver import native, optim, rowupdates
from paramserver.hashing import GOLDEN_GAMMA
from paramserver.optimconfig import OptimizerConfig
from paramserver.store.arena import RowArena
from paramserver.store.idmap import FusedIdMap
from paramserver.store.rowinit import init_values_and_state
from paramserver.trainer.lookups import unique_lookups
from tests.helpers import counted

compiled = pytest.mark.skipif(native.loops is None, reason="the compiled loops are off")


@compiled
@pytest.mark.parametrize("rule_name", ["adagrad", "sgd"])
@pytest.mark.parametrize("dim", [1, 7, 16, 32, 33])
@pytest.mark.parametrize(
    ("weight_decay", "initial"), [(0.0, 0.0), (0.01, 0.1), (1e-50, 0.0), (0.3, 2.0)]
)
def test_rows_stepped_in_place_are_bitwise_torch_optims(
    rule_name: str, dim: int, weight_decay: float, initial: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows stepped by the loop (in place) and by torch.optim's Adagrad or SGD (gathered,
    stepped, scattered) stay bitwise equal over steps with gradients from 1e-3 to 1e2 and lrs
    that change, and weight decays, one of them rounding to 0 in float32."""
    extra = {"initial_accumulator_value": initial} if rule_name == "adagrad" else {}
    config = OptimizerConfig(name=rule_name, lr=0.05, weight_decay=weight_decay, **extra)
    rule = optim.make_rule(config)
    g = torch.Generator().manual_seed(dim)
    start = torch.randn(300, dim, generator=g)
    tables = {}
    optim._adagrad_loop_rounding()  # their trial steps (once per process) are not counted
    optim._sgd_loop_rounding()
    stepped = counted(monkeypatch, "step_rows")
    for mode in ("compiled", "torch"):
        if mode == "torch":
            assert stepped[0] == 3  # one call per step, none of them left to torch.optim
            monkeypatch.setattr(native, "loops", None)
        weight = start.clone()
        state = rule.init_state(weight)
        g = torch.Generator().manual_seed(1)
        for lr in (0.05, 0.2, 0.01):
            rows = torch.randperm(300, generator=g)[:120]
            scales = 10.0 ** torch.randint(-3, 3, (120, 1), generator=g)
            grads = torch.randn(120, dim, generator=g) * scales
            rowupdates.apply_rows(rule, weight, state, None, rows, grads, lr)
        tables[mode] = (weight, state.get("sum"))
    assert not torch.equal(tables["torch"][0], start), "the test is vacuous"
    assert torch.equal(tables["compiled"][0], tables["torch"][0])
    if rule_name == "adagrad":
        assert torch.equal(tables["compiled"][1], tables["torch"][1])


@compiled
def test_a_fused_id_map_finds_the_same_rows_with_either_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Random inserts, searches and removals over 5 tables in two row groups: the compiled
    search and placement give every id the row numpy's do (slots may differ: placing ids one
    by one and in rounds are both valid layouts)."""
    searched, placed = counted(monkeypatch, "probe"), counted(monkeypatch, "place")
    loops = native.loops

    def run(use_loops: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(native, "loops", loops if use_loops else None)
        id_map = FusedIdMap(5, initial_slots=16, groups=[0, 1, 0, 1, 0])
        rng = np.random.default_rng(0)
        seen = []
        for step in range(60):
            ids = torch.from_numpy(rng.integers(-500, 500, 400) * 2**33)
            spaces = rng.integers(0, 5, 400)
            _, first = np.unique(spaces * 2**20 + ids.numpy() // 2**33, return_index=True)
            ids, spaces = ids[torch.from_numpy(first)], spaces[first]
            found = id_map.find(spaces, ids)
            absent = torch.from_numpy(np.flatnonzero(found.rows.numpy() < 0))
            id_map.insert(spaces[absent.numpy()], ids[absent], found.subset(absent))
            seen.append(id_map.lookup(spaces, ids))
            if step % 10 == 9:
                table_ids, _ = id_map.table(step % 5).live_rows()
                id_map.table(step % 5).remove(table_ids[::3])
        return seen

    with_loops = run(True)
    assert searched[0] >= 120 and placed[0] >= 59  # every search and insertion went through them
    assert all(torch.equal(a, b) for a, b in zip(with_loops, run(False), strict=True))


@compiled
def test_bad_arguments_raise_instead_of_reading_past_an_array() -> None:
    loops = native.loops
    assert loops is not None
    slots = np.full(16, -1, dtype=np.int32)
    slots[3] = 7  # names row 7 of a map of 2 rows
    row_ids = np.array([1, 2], dtype=np.int64)
    ids = np.arange(64, dtype=np.int64)
    out = np.empty(64, dtype=np.int64)

    def probe(slots: np.ndarray, found: np.ndarray = out) -> None:
        loops.probe(slots, row_ids, 8, -1, 1, -1, ids, None, GOLDEN_GAMMA, 0, found, out.copy(),
                    None)  # fmt: skip

    with pytest.raises(ValueError, match="past the end"):
        probe(slots)
    with pytest.raises(ValueError, match="mismatched"):
        probe(np.full(16, -1, dtype=np.int32), out[:5])
    with pytest.raises(ValueError, match="power of two"):
        probe(np.full(12, -1, dtype=np.int32))
    with pytest.raises(ValueError, match="no empty slot"):
        probe(np.zeros(16, dtype=np.int32))
    with pytest.raises(ValueError, match="outside int32"):
        loops.place(slots, ids[:2], None, np.array([1, 2**31]), GOLDEN_GAMMA, 0)
    assert slots.tolist().count(-1) == 15  # nothing placed by the refused call
    weight = np.zeros((4, 8), dtype=np.float32)
    grads = np.ones((2, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="past the table's end"):
        loops.step_rows(1, weight, weight.copy(), 8, np.array([1, 4]), grads, 0.1, 1e-10, 0.0, True)
    with pytest.raises(ValueError, match="mismatched"):
        loops.step_rows(1, weight, weight.copy(), 8, np.array([1]), grads, 0.1, 1e-10, 0.0, True)
    with pytest.raises(TypeError, match="contiguous buffer"):  # not contiguous
        loops.step_rows(1, weight[:, ::2], weight, 4, np.array([1]), grads, 0.1, 1e-10, 0, True)
    with pytest.raises(ValueError, match="mismatched"):  # SGD takes no sums
        loops.step_rows(0, weight, weight.copy(), 8, np.array([1]), grads[:1], 0.1, 0.0, 0.0, True)
    with pytest.raises(ValueError, match="no such rule"):
        loops.step_rows(2, weight, None, 8, np.array([1]), grads[:1], 0.1, 0.0, 0.0, True)
    assert not weight.any()  # nothing written by a refused call
    if native.takes_tensors():
        for groups in [(torch.arange(3),), [torch.arange(3)], [[torch.arange(3)], (7,)]]:
            with pytest.raises(TypeError, match="list of lists of tensors"):
                loops.unique_lookups(groups)
        # ids it does not read (left to torch): of other types, not 1-D, not tensors
        for ids in [torch.arange(3, dtype=torch.int16), torch.ones(3), torch.ones(2, 2).long(),
                    np.arange(3)]:  # fmt: skip
            assert loops.unique_lookups([[torch.arange(4)], [ids]]) is None


@compiled
@pytest.mark.parametrize("dim", [1, 7, 32])
@pytest.mark.parametrize("rule", ["adagrad", "rowwise_adagrad", "adam"])
def test_new_rows_made_by_the_loop_are_numpys(
    dim: int, rule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dynamic arena's new rows, values and every state slot (per value or per row), made
    by the compiled loop and by numpy and torch: bitwise the same, and rows not made are left
    as they were."""
    config = OptimizerConfig(name=rule, lr=0.1, initial_accumulator_value=0.25)
    rng = np.random.default_rng(dim)
    rows = rng.permutation(500)[:200]
    ids = rng.integers(-(2**62), 2**62, 200)
    salts = rng.integers(-(2**40), 2**40, 200)
    scales = rng.choice([0.01, 0.05, 1.0], 200)
    arenas = {}
    made_by_loop = counted(monkeypatch, "init_rows")
    for mode in ("compiled", "numpy"):
        if mode == "numpy":
            assert made_by_loop[0] == 1
            monkeypatch.setattr(native, "loops", None)
        arena = RowArena(dim, torch.float32, optim.make_rule(config), rows=500)
        arena.weight.fill_(7.0)
        for slot in arena.state.values():
            slot.fill_(7.0)
        init_values_and_state(arena, rows, ids, salts, scales)
        arenas[mode] = arena
    made, kept = arenas["compiled"], arenas["numpy"]
    assert torch.equal(made.weight, kept.weight) and made.state.keys() == kept.state.keys()
    assert all(torch.equal(made.state[k], kept.state[k]) for k in made.state)
    untouched = torch.ones(500, dtype=torch.bool)
    untouched[torch.from_numpy(rows)] = False
    assert bool((made.weight[untouched] == 7.0).all())
    assert bool((made.weight[torch.from_numpy(rows)].abs() <= 1.0).all())


MARKS_AT_THE_EDGE = """
import torch
from paramserver.trainer.lookups import unique_lookups
for span in (31, 32):  # 4 ids: 32 marks fill the workspace exactly; 33 would not fit
    part = torch.tensor([-7 + span, -7, -7 + span, -7 + span // 2])
    unique, _ = unique_lookups({"t": [part]})
    assert torch.equal(unique["t"], torch.unique(part))
"""


@compiled
def test_the_marks_of_dense_ids_stay_inside_their_workspace() -> None:
    """Under Python's debug allocator, which aborts the process on a write past an allocation:
    the most marks a part of 4 ids may take (a span of 31) fit the loop's workspace."""
    done = subprocess.run(
        [sys.executable, "-c", MARKS_AT_THE_EDGE],
        env={**os.environ, "PYTHONMALLOC": "debug"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def _expected_lookups(lookups: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """torch's unique ids of a table's lookups, and each lookup's positions among them."""
    joined = torch.cat([ids.long() for ids in lookups]) if lookups else torch.zeros(0).long()
    unique, inverse = torch.unique(joined, return_inverse=True)
    return unique, list(inverse.split([ids.numel() for ids in lookups]))


@compiled
def test_each_tables_unique_ids_from_the_loop_are_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sorted unique ids of each table's lookups and each id's index among them, as
    torch.unique gives them, and each lookup's ids as int64: tables of no lookups, of empty
    ones, alone, with repeats, over the whole int64 range (both ends), dense ones (ranked by
    marks, below 8 ids' span per id) at that edge, int32 ids, strided views."""
    if not native.takes_tensors():
        pytest.skip("the loops do not take tensors here")
    searched = counted(monkeypatch, "unique_lookups")
    g = torch.Generator().manual_seed(0)
    extremes = torch.tensor([2**63 - 1, -(2**63), 0, -1, 2**63 - 1, -(2**63), 5])
    recorded = {
        "none": [],
        "empty": [torch.zeros(0, dtype=torch.int64)],
        "small": [torch.randint(-3, 3, (1,), generator=g)],
        "repeats": [torch.randint(-3, 3, (5,), generator=g), torch.tensor([0, 3, 3, 1, 0, 2, 3])],
        "extremes": [extremes, torch.randint(-(2**62), 2**62, (512,), generator=g)],
        "dense": [torch.randint(-1000, 1000, (2048,), generator=g), torch.arange(3)],
        "int32": [torch.randint(0, 50, (40,), generator=g, dtype=torch.int32)],
        "strided": [torch.randint(0, 9, (6, 2), generator=g)[:, 1], torch.tensor([4, 4])],
    }
    for span in (31, 32):  # 4 ids: marked (a span under 32), then sorted
        recorded[f"span {span}"] = [torch.tensor([-7 + span, -7, -7 + span, -7 + span // 2])]
    unique, lookups = unique_lookups(recorded)
    assert searched[0] == 1
    assert list(unique) == list(lookups) == list(recorded)
    for table, each in recorded.items():
        expected_unique, expected_positions = _expected_lookups(each)
        assert torch.equal(unique[table], expected_unique), table
        assert lookups[table].ids is unique[table]
        assert len(lookups[table].each) == len(each)
        for (ids, positions), given, expected in zip(
            lookups[table].each, each, expected_positions, strict=True
        ):
            assert ids.dtype == torch.int64 and torch.equal(ids, given.long()), table
            assert torch.equal(positions, expected), table
    recorded["int32"][0][0] = 10**6  # the lookups' ids are a copy: the batch may change
    assert int(lookups["int32"].each[0][0][0]) != 10**6


def test_unique_ids_of_ids_the_loops_do_not_read_are_torchs() -> None:
    """Lookups of ids the loops do not read (int16 here) are left to torch, with the same
    results; so are all where the loops are off."""
    recorded = {"a": [torch.tensor([3, 1, 3], dtype=torch.int16)], "b": [torch.tensor([9, 2])]}
    unique, lookups = unique_lookups(recorded)
    assert torch.equal(unique["a"], torch.tensor([1, 3]))
    assert torch.equal(unique["b"], torch.tensor([2, 9]))
    ((ids, positions),) = lookups["a"].each
    assert ids.dtype == torch.int64 and torch.equal(positions, torch.tensor([1, 0, 1]))


@compiled
@pytest.mark.parametrize("dim", [1, 16, 33])
def test_a_steps_lookups_and_their_gradients_are_index_select_and_index_adds(dim: int) -> None:
    """gather_rows copies each lookup's rows as index_select does; scatter_rows adds each
    lookup's gradient rows into its table in index_add_'s order (repeated positions, several
    lookups of one table, a lookup without gradient): bitwise torch's."""
    g = torch.Generator().manual_seed(dim)
    tables = [torch.randn(rows, dim, generator=g) for rows in (5, 1, 40)]
    plan = [(0, 9), (2, 64), (0, 3), (1, 4), (2, 0)]
    positions = [torch.randint(0, tables[t].shape[0], (n,), generator=g) for t, n in plan]
    outputs = [torch.empty(n, dim) for _, n in plan]
    native.loops.gather_rows(
        [t.numpy() for t in tables],
        [(t, p.numpy(), o.numpy()) for (t, _), p, o in zip(plan, positions, outputs, strict=True)],
        dim,
    )
    for (t, _), p, out in zip(plan, positions, outputs, strict=True):
        assert torch.equal(out, tables[t].index_select(0, p))
    grads = [torch.randn(n, dim, generator=g) * 1e3 for _, n in plan]
    grads[3] = None
    summed = [torch.zeros_like(t) for t in tables]
    native.loops.scatter_rows(
        [s.numpy() for s in summed],
        [(t, p.numpy(), None if gr is None else gr.numpy())
         for (t, _), p, gr in zip(plan, positions, grads, strict=True)],
        dim,
    )  # fmt: skip
    expected = [torch.zeros_like(t) for t in tables]
    for (t, _), p, gr in zip(plan, positions, grads, strict=True):
        if gr is not None:
            expected[t].index_add_(0, p, gr)
    for got, want in zip(summed, expected, strict=True):
        assert torch.equal(got, want)


@compiled
def test_scattered_gradients_may_be_strided_rows() -> None:
    """A gradient whose rows lie apart (a stack's backward hands out such views) adds as its
    contiguous copy does, read in place; rows that are not each contiguous are refused."""
    g = torch.Generator().manual_seed(3)
    stacked = torch.randn(6, 3, 4, generator=g)  # 6 rows of 3 lookups, each 4 wide
    positions = torch.tensor([0, 2, 2, 1, 0, 2])
    strided, copied = np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float32)
    for table, grads in ((strided, stacked[:, 1]), (copied, stacked[:, 1].contiguous())):
        native.loops.scatter_rows([table], [(0, positions.numpy(), grads.numpy())], 4)
    expected = torch.zeros(3, 4).index_add_(0, positions, stacked[:, 1])
    assert torch.equal(torch.from_numpy(strided), expected)
    assert torch.equal(torch.from_numpy(copied), expected)
    across = stacked[:, :, 0].numpy()  # rows of 3 floats 4 apart: not contiguous rows
    with pytest.raises(ValueError, match="not rows of contiguous floats"):
        native.loops.scatter_rows(
            [np.zeros((3, 3), np.float32)], [(0, positions.numpy(), across)], 3
        )
    flat = np.arange(48, dtype=np.float32)
    for spaced in (flat[::2], flat[23::-1]):  # one dimension, not end to end
        with pytest.raises(ValueError, match="not rows of contiguous floats"):
            native.loops.scatter_rows(
                [np.zeros((3, 4), np.float32)], [(0, positions.numpy(), spaced)], 4
            )


@compiled
def test_bad_lookups_are_refused_before_anything_is_written() -> None:
    loops = native.loops
    tables = [np.zeros((4, 2), dtype=np.float32), np.zeros((2, 2), dtype=np.float32)]
    grads = np.ones((2, 2), dtype=np.float32)
    good = (0, np.array([0, 3]), grads)
    bad = {
        "past its table's end": (1, np.array([0, 2]), grads),
        "of no table": (2, np.array([0, 1]), grads),
        "differ in number": (0, np.array([0]), grads),
    }
    for reason, lookup in bad.items():
        with pytest.raises(ValueError, match=reason):
            loops.scatter_rows(tables, [good, lookup], 2)
    with pytest.raises(ValueError, match="without rows"):
        loops.gather_rows(tables, [(0, np.array([0]), None)], 2)
    with pytest.raises(ValueError, match="whole rows"):
        loops.gather_rows([np.zeros(3, dtype=np.float32)], [], 2)
    for width in (0, 2**62):  # 2**62: sizes in bytes would overflow
        with pytest.raises(ValueError, match="width"):
            loops.scatter_rows(tables, [good], width)
    with pytest.raises(TypeError, match="tuple"):
        loops.scatter_rows(tables, [list(good)], 2)
    with pytest.raises(ValueError, match="not C-contiguous"):  # a strided table
        loops.scatter_rows([tables[0][:, :1]], [(0, np.array([0]), grads[:1, :1].copy())], 1)
    assert not any(table.any() for table in tables)  # nothing added by a refused call


@compiled
def test_the_finite_check_finds_every_nan_and_inf_and_passes_every_finite_value() -> None:
    """``all_finite`` reads bits, not sums: every value of every exponent and sign, and NaNs
    of any payload, answer as ``np.isfinite`` does, wherever in which array they are."""
    loops = native.loops
    g = np.random.default_rng(0)
    bits = g.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    bits[:512] = np.arange(512, dtype=np.uint32) << 23  # every exponent with both signs
    values = bits.view(np.float32)
    finite = np.isfinite(values)
    assert 0 < finite.sum() < values.size
    for at in list(range(512)) + g.integers(0, values.size, 300).tolist():
        one = np.ones(37, dtype=np.float32)
        one[at % 37] = values[at]
        assert loops.all_finite([np.ones(5, dtype=np.float32), one]) == finite[at]
    assert loops.all_finite([values[finite]])
    assert loops.all_finite([])
    with pytest.raises(TypeError, match="another type"):
        loops.all_finite([np.ones(3, dtype=np.float32), np.ones(3)])
    with pytest.raises(ValueError, match="not C-contiguous"):
        loops.all_finite([np.ones((3, 3), dtype=np.float32)[:, 0]])


@compiled
def test_id_sets_rise_within_their_bounds_exactly_as_numpy_says() -> None:
    loops = native.loops
    g = np.random.default_rng(1)
    for _ in range(300):
        sets = [np.sort(g.integers(-5, 20, g.integers(0, 6))) for _ in range(g.integers(1, 4))]
        bounds = [tuple(sorted(g.integers(-6, 22, 2).tolist())) for _ in sets]
        expected = all(
            (ids[1:] > ids[:-1]).all() and (not ids.size or (low <= ids[0] and ids[-1] <= high))
            for ids, (low, high) in zip(sets, bounds, strict=True)
        )
        assert loops.ascending_within(sets, bounds) == expected
    extremes = np.array([-(2**63), 2**63 - 1])
    assert loops.ascending_within([extremes], [(-(2**63), 2**63 - 1)])
    with pytest.raises(TypeError, match="another type"):
        loops.ascending_within([np.arange(3, dtype=np.int32)], [(0, 5)])
    with pytest.raises(ValueError, match="one \\(low, high\\) per array"):
        loops.ascending_within([np.arange(3)], [])
    with pytest.raises(TypeError):
        loops.ascending_within([np.arange(3)], [(0,)])


@compiled
@pytest.mark.parametrize("rule_name", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("dim", [7, 16, 33])
@pytest.mark.parametrize("weight_decay", [0.0, 0.3])
def test_own_updates_by_the_loop_are_the_servers_updates(
    rule_name: str, dim: int, weight_decay: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer's own update of pulled rows by the loop, two tables in one call, is bitwise
    what torch.optim makes of the same rows on a server (apply_rows), state included; a row
    asked whose id has no gradient keeps its value and state."""
    config = OptimizerConfig(name=rule_name, lr=0.1, weight_decay=weight_decay)  # type: ignore[arg-type]
    rule = optim.make_rule(config)
    g = torch.Generator().manual_seed(dim)
    tables, places, states, expected = [], [], [], []
    for lr in (0.1, 0.02):
        ids = torch.randperm(500, generator=g)[:60].sort().values
        values = torch.randn(60, dim, generator=g)
        at = torch.randperm(60, generator=g)[:40]  # servers' parts: not in order
        held = rule.init_state(values)
        for slot in held.values():
            slot.uniform_(0.0, 2.0, generator=g)
        grad_ids = torch.cat([ids[at[:30]], torch.tensor([501, 502])]).sort().values
        grads = torch.randn(grad_ids.numel(), dim, generator=g) * 10.0 ** torch.randint(
            -3, 3, (grad_ids.numel(), 1), generator=g
        )
        states.append({slot: value[at].clone() for slot, value in held.items()})
        places.append(at.numpy())
        tables.append(optim.PulledTable(values.clone(), ids, grad_ids, grads, lr))
        before = values.clone()
        with monkeypatch.context() as torch_only:
            torch_only.setattr(native, "loops", None)
            taking = torch.searchsorted(grad_ids, ids[at[:30]])
            rowupdates.apply_rows(rule, values, held, None, at[:30], grads[taking], lr)
        expected.append((values, {slot: value[at] for slot, value in held.items()}))
    # Both tables' rows end to end, the second's first: spans need not follow the tables.
    state = {slot: torch.cat([states[1][slot], states[0][slot]]) for slot in states[0]}
    rows = optim.PulledRows(
        tables, np.concatenate([places[1], places[0]]), np.array([[40, 80], [0, 40]]), state
    )
    if rule_name == "rowwise_adagrad" and (weight_decay or not optim._rowwise_loop_agrees()):
        assert rule.step_pulled_rows(rows) is None  # left to torch
        return
    assert rule.step_pulled_rows(rows) == 60
    for j, (table, (values, expected_state)) in enumerate(zip(tables, expected, strict=True)):
        assert torch.equal(table.values, values)
        for slot, value in expected_state.items():
            assert torch.equal(state[slot][40 * (1 - j) : 40 * (2 - j)], value), slot
    assert not torch.equal(before, expected[-1][0]), "the test is vacuous"
    assert torch.equal(before[at[30:]], expected[-1][0][at[30:]])  # no gradient: no update


@compiled
def test_bad_own_rows_are_refused_before_anything_is_written() -> None:
    values, grads = np.zeros((4, 2), np.float32), np.ones((2, 2), np.float32)
    ids, grad_ids, sums = np.arange(4), np.array([0, 1]), np.zeros((2, 2), np.float32)

    def own(at: np.ndarray, state: np.ndarray | None = sums, spans: Any = None) -> int:
        table = (values, 2, ids, grad_ids, grads, None, 0.1)
        spans = np.array([[0, at.size]] if spans is None else spans, dtype=np.int64)
        return native.own_rows(
            "adagrad", [table], at, state, spans, eps=1e-10, weight_decay=0.0, fused=False
        )

    with pytest.raises(ValueError, match="a place past the pulled rows"):
        own(np.array([0, 4]))
    with pytest.raises(ValueError, match="mismatched sizes"):
        own(np.array([0]))  # two states for one place
    with pytest.raises(ValueError, match="mismatched sizes"):
        own(np.array([0, 1]), None)  # Adagrad without its sums
    with pytest.raises(ValueError, match="a span past the places"):
        own(np.array([0, 1]), spans=[[1, 3]])
    with pytest.raises(ValueError, match="a span past the places"):
        own(np.array([0, 1]), spans=[[1, 0]])
    with pytest.raises(ValueError, match="mismatched sizes"):
        own(np.array([0, 1]), spans=[[0, 1], [1, 2]])  # a span for a table not given
    assert not values.any() and not sums.any()
    assert own(np.array([3, 1])) == 1 and values[1].all() and not values[3].any()


@compiled
def test_own_rows_of_every_row_step_each_table_as_its_places_in_order_do() -> None:
    """at and spans None (plain SGD's known tables): every pulled row of each table, as the
    places of all its rows in order step them; refused with state or with spans alone."""
    rng = np.random.default_rng(5)
    tables, counts = [], [300, 0, 50]
    for count in counts:
        ids = np.sort(rng.choice(1_000, count, replace=False))
        grad_ids = np.sort(rng.choice(1_000, 200, replace=False))
        grads = rng.standard_normal((200, 4)).astype(np.float32)
        values = rng.standard_normal((count, 4)).astype(np.float32)
        tables.append((values, 4, ids, grad_ids, grads, None, 0.5))
    copies = [(v.copy(), *rest) for v, *rest in tables]
    ends = np.cumsum(counts)
    at = np.concatenate([np.arange(n) for n in counts])
    spans = np.stack([ends - np.array(counts), ends], axis=1)
    by_places = native.own_rows(
        "sgd", copies, at, None, spans, eps=0.0, weight_decay=0.0, fused=True
    )
    every = native.own_rows("sgd", tables, None, None, None, eps=0.0, weight_decay=0.0, fused=True)
    assert every == by_places > 0
    for (values, *_), (expected, *_) in zip(tables, copies, strict=True):
        assert np.array_equal(values, expected)
    sums = np.zeros((sum(counts), 4), np.float32)
    with pytest.raises(ValueError, match="mismatched sizes"):  # a rule with state needs places
        native.own_rows(
            "adagrad", tables, None, sums, None, eps=1e-10, weight_decay=0.0, fused=True
        )
    with pytest.raises(ValueError, match="mismatched sizes"):
        native.own_rows("sgd", tables, None, None, spans, eps=0.0, weight_decay=0.0, fused=True)


@compiled
@pytest.mark.parametrize("order", ["ascending", "descending", "shuffled"])
def test_own_rows_find_each_rows_gradient_in_any_order(order: str) -> None:
    """Each row's gradient is found among the gradients' sorted ids (rows in ascending id
    order, the usual case, as the search gallops on, or in any other), and a row whose id has
    none takes no update: plain SGD against numpy."""
    rng = np.random.default_rng(4)
    ids = np.sort(rng.choice(10_000, 3_000, replace=False))
    grad_ids = np.sort(rng.choice(ids, 1_000, replace=False))
    grads = rng.standard_normal((1_000, 4)).astype(np.float32)
    at = rng.choice(3_000, 2_000, replace=False)
    at = {"ascending": np.sort(at), "descending": np.sort(at)[::-1].copy(), "shuffled": at}[order]
    values = rng.standard_normal((3_000, 4)).astype(np.float32)
    expected = values.copy()
    for place in at:
        found = np.searchsorted(grad_ids, ids[place])
        if found < grad_ids.size and grad_ids[found] == ids[place]:
            expected[place] = expected[place] + np.float32(-0.5) * grads[found]
    table = (values, 4, ids, grad_ids, grads, None, 0.5)
    spans = np.array([[0, at.size]], dtype=np.int64)
    updated = native.own_rows(
        "sgd", [table], at, None, spans, eps=0.0, weight_decay=0.0, fused=False
    )
    assert updated == int(np.isin(ids[at], grad_ids).sum()) > 0
    assert np.array_equal(values, expected)


@compiled
def test_the_row_wise_loop_is_taken_where_it_agrees_with_torch_on_rows_it_never_saw() -> None:
    """Row-wise Adagrad's own update takes its loop only where the trial finds it torch's:
    then it agrees on other rows too, else some of them differ (on AVX-512, whose square
    root is not IEEE's)."""
    config = OptimizerConfig(name="rowwise_adagrad", lr=0.05)
    g = torch.Generator().manual_seed(11)
    values = torch.randn(4096, 16, generator=g)
    sums = torch.rand(4096, 1, generator=g) * 5.0
    grads = torch.randn(4096, 16, generator=g)
    looped, looped_sums = values.clone(), sums.clone()
    table = optim.PulledTable(looped, torch.arange(4096), torch.arange(4096), grads, 0.05)
    pulled = optim.PulledRows([table], np.arange(4096), np.array([[0, 4096]]), {"sum": looped_sums})
    means = [grads.square().mean(dim=1)]
    assert optim._own_rows("rowwise_adagrad", pulled, config, False, slot="sum", means=means)
    stepped = optim.Block(values.clone(), grads, {"sum": sums.clone()}, torch.zeros(()))
    optim.make_rule(config).step_blocks([stepped], 0.05)
    assert not torch.equal(stepped.param, values), "the test is vacuous"
    agree = torch.equal(looped, stepped.param) and torch.equal(looped_sums, stepped.state["sum"])
    assert optim._rowwise_loop_agrees() == agree
