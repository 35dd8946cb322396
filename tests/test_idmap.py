"""The dynamic tables' id map (paramserver.store.idmap): collisionless for any int64, one map shared
by several tables like one per table, rows reused, arrays grown in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paramserver import native
from paramserver.store.idmap import FusedIdMap, IdMap
from paramserver.store.probing import HASHING, home
from tests.helpers import EXTREMES

# Every test runs with the compiled loops and with numpy only (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("loop_mode")


def test_id_map_is_collisionless_for_any_int64() -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.tensor(EXTREMES), torch.randint(-(2**62), 2**62, (5000,), generator=g)])
    ids = ids.unique()
    id_map = IdMap(initial_slots=16)
    rows = id_map.insert(ids)
    assert rows.unique().numel() == ids.numel()
    repeated = ids[torch.randint(0, ids.numel(), (20000,), generator=g)]
    assert torch.equal(id_map.lookup(repeated), rows[torch.searchsorted(ids, repeated)])
    absent = torch.tensor([5, 6, 7]) * 2**40 + 3
    assert not bool(torch.isin(absent, ids).any())
    assert id_map.lookup(absent).tolist() == [-1, -1, -1]
    live_ids, live_rows = id_map.live_rows()
    assert torch.equal(live_ids, ids) and torch.equal(live_rows, rows)


def test_id_map_inserts_after_a_search_land_where_lookups_find_them() -> None:
    """Inserting with what ``find`` learned (the empty slots that ended each search, some
    shared by several new ids, some behind deleted slots) gives the same map as inserting
    without it."""
    g = torch.Generator().manual_seed(1)
    hinted, plain = IdMap(initial_slots=64), IdMap(initial_slots=64)
    everything = torch.empty(0, dtype=torch.int64)
    for _ in range(40):
        # Nearby ids share probe sequences, so their searches often end at one empty slot.
        batch = torch.randint(0, 3000, (60,), generator=g).unique()
        found = hinted.find(batch)
        absent = (found.rows < 0).nonzero().squeeze(1)
        hinted.insert(batch[absent], found.subset(absent))
        plain.insert(batch[plain.lookup(batch) < 0])
        gone = batch[torch.randint(0, batch.numel(), (10,), generator=g)].unique()
        hinted.remove(gone)
        plain.remove(gone)
        everything = torch.cat([everything, batch])
    queries = everything.unique()
    assert torch.equal(hinted.lookup(queries) >= 0, plain.lookup(queries) >= 0)
    ids_hinted, rows_hinted = hinted.live_rows()
    assert torch.equal(ids_hinted, plain.live_rows()[0])
    assert torch.equal(hinted.lookup(ids_hinted), rows_hinted)


@pytest.mark.parametrize("seed", range(4))
def test_a_fused_id_map_behaves_like_one_map_per_table(seed: int) -> None:
    """Random inserts (with and without what a search learned), lookups and removals over
    several tables, the same ids in several of them: each table's rows, ids and free-row reuse
    are those of a map of its own."""
    g = torch.Generator().manual_seed(seed)
    tables = 5
    fused = FusedIdMap(tables, initial_slots=16)
    own = [IdMap(initial_slots=16) for _ in range(tables)]
    for _ in range(60):
        spaces = torch.randint(0, tables, (200,), generator=g).numpy().astype(np.int16)
        ids = torch.randint(-50, 400, (200,), generator=g)
        ids[::7] = torch.tensor(EXTREMES)[torch.arange(ids[::7].numel()) % len(EXTREMES)]
        keys = np.unique(np.stack([spaces.astype(np.int64), ids.numpy()]), axis=1)
        spaces, ids = keys[0].astype(np.int16), torch.from_numpy(keys[1].copy())
        found = fused.find(spaces, ids)
        absent = (found.rows < 0).nonzero().squeeze(1)
        hinted = bool(torch.rand((), generator=g) < 0.5)
        new = fused.insert(
            spaces[absent.numpy()], ids[absent], found.subset(absent) if hinted else None
        )
        for table, map_ in enumerate(own):
            mine = torch.from_numpy(spaces == table)
            assert torch.equal(found.rows[mine], map_.lookup(ids[mine]))
            expected = map_.insert(ids[mine][map_.lookup(ids[mine]) < 0])
            assert torch.equal(new[torch.from_numpy(spaces[absent.numpy()] == table)], expected)
            gone = ids[mine][torch.rand(int(mine.sum()), generator=g) < 0.2]
            assert torch.equal(
                fused.remove(table, gone).sort().values, map_.remove(gone).sort().values
            )
    for table, map_ in enumerate(own):
        ids, rows = fused.live_rows(table)
        assert torch.equal(ids, map_.live_rows()[0]) and torch.equal(rows, map_.live_rows()[1])
        view = fused.table(table)
        assert view.num_rows == map_.num_rows and view.used_rows == map_.used_rows
        assert torch.equal(view.lookup(ids), rows)


@pytest.mark.parametrize("spaces", [0, 3])
def test_a_rebuilt_slot_array_finds_every_id_as_one_placed_round_by_round(spaces: int) -> None:
    """A rebuild places all ids in one pass (by home slot, a running maximum; those running
    past the end wrap around): every id is found at its row and absent ids stay absent, as
    after placing them round by round, also where many ids wrap (arrays of 16 to 64 slots
    filled to 0.6)."""
    g = torch.Generator().manual_seed(3)
    wrapped = 0
    for trial in range(200):
        size = 16 << (trial % 3)
        id_map = IdMap(initial_slots=size, spaces=spaces)
        count = int(size * 0.6)
        ids = torch.randint(-(2**40), 2**40, (count,), generator=g).unique()
        keys = torch.randint(0, max(spaces, 1), (ids.numel(),), generator=g).numpy()
        kinds = keys.astype(np.int16) if spaces else None
        rows = np.arange(ids.numel(), dtype=np.int64)
        id_map._set_capacity(ids.numel())
        id_map.row_ids[:] = ids.numpy()
        if kinds is not None:
            id_map.row_spaces[:] = kinds
        id_map.num_rows = id_map.used_rows = ids.numel()
        id_map._build(ids.numpy(), rows, kinds)
        slots = id_map._probe(ids.numpy(), kinds)[1]
        homes = home(id_map.slots, ids.numpy(), kinds, HASHING)
        wrapped += int((slots < homes).any())  # past the end
        assert torch.equal(id_map.lookup(ids, kinds), torch.from_numpy(rows))
        placed = IdMap(initial_slots=size, spaces=spaces)
        placed.records = id_map.records
        placed.row_ids, placed.row_spaces = id_map.row_ids, id_map.row_spaces
        placed.num_rows = placed.used_rows = ids.numel()
        placed._place(ids.numpy(), rows, kinds)
        assert sorted(id_map.slots.tolist()) == sorted(placed.slots.tolist())
        absent = ids + 1
        absent = absent[~torch.isin(absent, ids)]
        kinds_absent = None if kinds is None else kinds[: absent.numel()]
        assert bool((id_map.lookup(absent, kinds_absent) < 0).all())
    assert wrapped > 10  # many arrays had ids run past the end


def test_id_map_reuses_freed_rows_and_stays_small() -> None:
    id_map = IdMap()
    first = id_map.insert(torch.arange(1000) * 7919)
    # Storage grown from nothing holds exactly the rows asked for: no slack yet.
    assert id_map.capacity_rows == first.numel() == 1000
    freed = id_map.remove(torch.arange(0, 1000, 2) * 7919)
    assert freed.numel() == 500 and id_map.num_rows == 500
    again = id_map.insert(torch.arange(5000, 5500))
    assert set(again.tolist()) == set(freed.tolist())  # freed rows reused...
    assert id_map.capacity_rows == 1000  # ...so storage did not grow
    id_map.insert(torch.tensor([-1]))  # one row past it grows storage, its slack bounded
    assert 1001 <= id_map.capacity_rows <= 1000 * 1.15 + 16
    assert (id_map.lookup(torch.arange(1, 1000, 2) * 7919) >= 0).all()
    assert (id_map.lookup(torch.arange(0, 1000, 2) * 7919) == -1).all()
    big = IdMap()
    big.insert(torch.randint(-(2**62), 2**62, (200_000,)).unique())
    assert big.nbytes() / big.num_rows <= 32


@pytest.mark.parametrize("spaces", [0, 3])
def test_id_map_arrays_grow_in_place_within_their_reservation(spaces: int) -> None:
    """A growth of the per-row arrays reserves room for RESERVE_GROWTH times the rows; growths
    within it keep the arrays where they are (no copy), with every id at its row."""
    id_map = IdMap(initial_slots=16, spaces=spaces)
    ids = torch.arange(500, dtype=torch.int64) * 7919 - 10**12
    where = np.zeros(500, dtype=np.int16) if spaces else None
    rows = [id_map.insert(ids[:100], None, None if where is None else where[:100])]
    address = id_map.row_ids.ctypes.data
    for start in range(100, 500, 100):  # 5 x the first capacity: within 8 x
        part = slice(start, start + 100)
        rows.append(id_map.insert(ids[part], None, None if where is None else where[part]))
    assert id_map.row_ids.ctypes.data == address and id_map.capacity_rows >= 500
    assert torch.equal(id_map.lookup(ids, where), torch.cat(rows))


@pytest.mark.parametrize("spaces", [0, 3])
def test_rebuilds_keep_every_live_id_at_its_row_and_drop_deleted_slots(spaces: int) -> None:
    """Growing from 16 slots through many rebuilds, with ids deleted between inserts (their
    slots marked deleted, their rows reused): after each insert every live id is found at its
    row, every removed id is absent, and a rebuild leaves no deleted slot behind."""
    g = torch.Generator().manual_seed(5)
    id_map = IdMap(initial_slots=16, spaces=spaces)
    live: dict[tuple[int, int], int] = {}  # (space, id) -> row
    layouts = id_map.layout
    for _ in range(40):
        ids = torch.randint(-(2**62), 2**62, (97,), generator=g).unique()
        where = torch.randint(0, max(spaces, 1), (ids.numel(),), generator=g).numpy()
        kinds = where.astype(np.int16) if spaces else None
        rows = id_map.insert(ids, None, kinds).tolist()
        live.update(zip(zip(where.tolist(), ids.tolist(), strict=True), rows, strict=True))
        if id_map.layout != layouts:  # rebuilt by this insert: only live slots carried over
            layouts = id_map.layout
            assert id_map.num_deleted_slots == 0 and not (id_map.slots == -2).any()
        gone = list(live)[::3][:20]
        for space in {s for s, _ in gone}:
            removed = torch.tensor(sorted(i for s, i in gone if s == space))
            id_map.remove(removed, np.full(removed.numel(), space, np.int16) if spaces else None)
        for key in gone:
            del live[key]
        keys = list(live)
        found = id_map.lookup(
            torch.tensor([i for _, i in keys]),
            np.array([s for s, _ in keys], dtype=np.int16) if spaces else None,
        )
        assert found.tolist() == [live[key] for key in keys]
        absent = id_map.lookup(
            torch.tensor([i for _, i in gone]),
            np.array([s for s, _ in gone], dtype=np.int16) if spaces else None,
        )
        assert bool((absent < 0).all())
    assert layouts >= 4  # grown through several rebuilds
    assert int((id_map.slots >= 0).sum()) == id_map.num_rows == len(live)


def test_a_rebuild_refuses_a_slot_naming_a_row_past_the_records() -> None:
    """The compiled rebuild checks every row number it follows (as the probe does)."""
    if native.loops is None:
        pytest.skip("the numpy path reads rows by numpy's own bounds checks")
    records = np.arange(4, dtype=np.int64)
    old = np.array([0, 9, -1, -1], dtype=np.int32)  # row 9 of 4
    with pytest.raises(ValueError, match="past the end"):
        native.rehash(old, records, np.full(8, -1, np.int32), HASHING, lambda *_: None)


def test_tables_of_one_row_group_get_its_rows_table_by_table_in_any_order_given() -> None:
    """Tables sharing a row group get its rows table by table, each table's in the order its
    ids are given: ids given table by table (as a read of several tables gives them) get the
    rows that the same ids given mixed get, fresh rows and freed ones alike."""
    g = torch.Generator().manual_seed(7)
    by_table = FusedIdMap(3, initial_slots=16, groups=[0, 0, 0])
    mixed = FusedIdMap(3, initial_slots=16, groups=[0, 0, 0])
    for _ in range(20):
        ids = torch.randint(-(2**40), 2**40, (60,), generator=g).unique()
        ids = ids[torch.randperm(ids.numel(), generator=g)]
        spaces = torch.randint(0, 3, (ids.numel(),), generator=g).numpy().astype(np.int16)
        mixed_rows = mixed.insert(spaces, ids)
        order = np.argsort(spaces, kind="stable")  # table by table, each in the given order
        rows = by_table.insert(spaces[order], ids[torch.from_numpy(order)])
        assert torch.equal(rows, mixed_rows[torch.from_numpy(order)])
        for table in range(3):
            gone = ids[torch.from_numpy(spaces == table)][::4]
            freed = by_table.remove(table, gone).sort().values
            assert torch.equal(freed, mixed.remove(table, gone).sort().values)
    assert by_table.used_rows == mixed.used_rows and by_table.num_rows == mixed.num_rows
