"""A vectorized, collisionless map from int64 ids to row numbers: the index of a server's dynamic
tables and of a trainer's row cache (a data structure of neither role, so both use it).

Open addressing with linear probing over a power-of-two array of ``slots`` (int32 row numbers;
-1 empty, -2 deleted). The keys are not stored in the slots: ``row_ids[row]`` holds each row's
id, so a probe compares ``row_ids[slots[h]]`` with the id. That keeps the map's memory at
4 bytes per slot plus 8 per row (about 13-19 bytes per row at the load factors kept here,
against 24-32 for a slot array of int64 keys and int32 values).

Every operation works on a whole batch of ids: its search, placement and rebuilds are the
compiled loops' (:mod:`paramserver.native`), or rounds of array operations
(:mod:`paramserver.store.probing`) where there are none; this module keeps the rows' books.
The arrays are numpy arrays and the calls take and return torch tensors (shared memory, no
copies): a step looks up a few hundred ids per table, where numpy's per-operation cost is a
fraction of torch's.

Rows are numbered densely from 0; a deleted row's number is reused by a later insert, so the
storage of an evicted row is reused rather than grown. Not thread-safe: its owner serializes
calls (a table under its lock; a trainer's cache from the trainer's one loop).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from paramserver import native
from paramserver.store import probing
from paramserver.store.growth import grown_array, grown_rows
from paramserver.store.probing import DELETED, EMPTY, HASHING

MAX_LOAD = 0.5  # grow the slot array past this load...
REHASH_LOAD = 0.4  # ...to the smallest power of two at or under this one


def _record(spaces: int) -> np.dtype:
    """A row's record in a map keyed by space: its id, payload and space, packed (13 bytes
    where spaces fit an int8, as the three arrays they replace took)."""
    space = "<i1" if spaces <= 128 else "<i2"
    size = 12 + np.dtype(space).itemsize
    return np.dtype(
        {"names": ["id", "payload", "space"], "formats": ["<i8", "<i4", space],
         "offsets": [0, 8, 12], "itemsize": size}
    )  # fmt: skip


class Found(NamedTuple):
    """What :meth:`IdMap.find` learned of a batch of ids."""

    rows: Tensor  # row of each id, -1 where absent
    ends: np.ndarray  # slot where each search ended: the id's own, or the empty one that ended it
    layout: int  # the slot array these slots refer to (see IdMap.layout)

    def subset(self, index: np.ndarray) -> Found:
        return Found(torch.from_numpy(self.rows.numpy()[index]), self.ends[index], self.layout)


class IdMap:
    def __init__(self, initial_slots: int = 1024, *, spaces: int = 0):
        """``initial_slots`` is rounded up to a power of two; the map grows as needed.
        ``spaces``: with more than 0, keys are (space, id) pairs, every call passing each id's
        space in ``range(spaces)`` (as :class:`FusedIdMap` uses it)."""
        size = 1 << max(4, (initial_slots - 1).bit_length())
        self.slots = np.full(size, EMPTY, dtype=np.int32)
        # Each row's record, capacity_rows long, which a search reads: its id; keyed by space,
        # its id, space and payload (an int32 its owner keeps there) side by side, so a probe's
        # reads of them share a cache line. row_ids, row_spaces and row_payloads view their
        # fields (row_ids: the records themselves, where a record is an id).
        self.records = np.empty(0, dtype=_record(spaces) if spaces else np.int64)
        self.row_ids = self.records
        self.row_spaces: np.ndarray | None = None  # keyed by space only
        self.row_payloads: np.ndarray | None = None
        self._set_capacity(0)
        self.used_rows = 0  # row numbers handed out so far (live plus free)
        self.free_rows = np.empty(0, dtype=np.int64)  # deleted row numbers, reused first
        self.num_rows = 0  # live rows
        self.num_deleted_slots = 0
        self.layout = 0  # bumped whenever the slot array is rebuilt

    @property
    def capacity_rows(self) -> int:
        """Rows the table's storage must hold: grows by ROW_GROWTH when row numbers run out."""
        return self.records.size

    def nbytes(self) -> int:
        return self.slots.nbytes + self.records.nbytes + self.free_rows.nbytes

    def _set_capacity(self, rows: int) -> None:
        """Grow the records to ``rows`` rows (and the views of their fields)."""
        self.records = grown_array(self.records, rows)
        if self.records.dtype.names is None:  # a row's record is its id
            self.row_ids = self.records
            return
        self.row_ids = self.records["id"]
        self.row_spaces = self.records["space"]
        self.row_payloads = self.records["payload"]

    # ---- calls: torch tensors in and out; ``spaces`` only for a map keyed by space ----

    def lookup(self, ids: Tensor, spaces: np.ndarray | None = None) -> Tensor:
        """Row of each id, -1 where the id is absent."""
        return torch.from_numpy(self._probe(ids.numpy(), spaces)[0])

    def find(self, ids: Tensor, spaces: np.ndarray | None = None) -> Found:
        """Like :meth:`lookup`, also remembering where each search ended, so that inserting
        the absent ids right after needs no second search."""
        rows, ends, _ = self._probe(ids.numpy(), spaces)
        return Found(torch.from_numpy(rows), ends, self.layout)

    def find_payloads(self, ids: Tensor, spaces: np.ndarray) -> Found:
        """:meth:`find` in a map keyed by space, each id's payload (-1: absent) in place of
        its row: read with the row's record, so it costs no second read."""
        _, ends, payloads = self._probe(ids.numpy(), spaces)
        assert payloads is not None, "only a map keyed by space keeps payloads"
        return Found(torch.from_numpy(payloads.astype(np.int64)), ends, self.layout)

    def insert(
        self,
        ids: Tensor,
        found: Found | None = None,
        spaces: np.ndarray | None = None,
        payloads: np.ndarray | None = None,
    ) -> Tensor:
        """Add ``ids`` (unique, all absent) and return their new rows. ``found``: what
        :meth:`find` returned for exactly these ids, if nothing was inserted since. A map
        keyed by space takes each id's space and payload."""
        keys = ids.numpy()
        count = keys.size
        if count == 0:
            return torch.empty(0, dtype=torch.int64)
        self._reserve(self.num_rows + count)
        reused = self.free_rows[:count]
        self.free_rows = self.free_rows[count:]
        start = self.used_rows
        self.used_rows += count - reused.size
        if self.used_rows > self.records.size:
            self._set_capacity(grown_rows(self.records.size, self.used_rows))
        rows = np.concatenate([reused, np.arange(start, self.used_rows)])
        if self.row_spaces is None:
            self.row_ids[rows] = keys
        else:
            assert spaces is not None, "a map keyed by space needs each id's space"
            self._write_records(reused, start, keys, spaces, payloads)
        # Where each search ended holds for the slot array searched, and saves numpy's rounds.
        if found is None or found.layout != self.layout or native.placing_is_cheap():
            self._place(keys, rows, spaces)
        else:
            left = probing.claim_ends(self.slots, found.ends, rows)
            if left.any():
                self._place(keys[left], rows[left], None if spaces is None else spaces[left])
        self.num_rows += count
        return torch.from_numpy(rows)

    def _write_records(
        self,
        reused: np.ndarray,
        start: int,
        keys: np.ndarray,
        spaces: np.ndarray,
        payloads: np.ndarray | None,
    ) -> None:
        """Set the records of new rows: freed rows ``reused`` (the first of ``keys``), then
        fresh ones from ``start`` on. Payloads not given are -1."""
        fresh = self.records[start : start + keys.size - reused.size]  # a view: written in place
        parts = [(fresh, slice(reused.size, None))]
        if reused.size:
            # Built whole, then copied in: a structured array's fields are written faster so
            # than each scattered to the freed rows.
            parts.append((np.empty_like(self.records, shape=reused.size), slice(reused.size)))
        for records, taken in parts:
            records["id"] = keys[taken]
            records["space"] = spaces[taken]
            records["payload"] = EMPTY if payloads is None else payloads[taken]
        if reused.size:
            self.records[reused] = parts[1][0]

    def remove(self, ids: Tensor, spaces: np.ndarray | None = None) -> Tensor:
        """Delete ``ids`` (unique); returns the freed rows (absent ids are ignored)."""
        rows, positions, _ = self._probe(ids.numpy(), spaces)
        present = rows >= 0
        rows, positions = rows[present], positions[present]
        self.slots[positions] = DELETED
        self.num_deleted_slots += rows.size
        self.num_rows -= rows.size
        self.free_rows = np.concatenate([self.free_rows, rows])
        return torch.from_numpy(rows)

    def live_rows(self) -> tuple[Tensor, Tensor]:
        """Ids and rows of every live entry, sorted by id."""
        occupied = self._occupied()
        ids = self.row_ids[occupied]
        order = np.argsort(ids, kind="stable")
        return torch.from_numpy(ids[order]), torch.from_numpy(occupied[order])

    # ---- internals, on numpy arrays ----

    def _occupied(self) -> np.ndarray:
        """The row of every occupied slot, in slot order."""
        return self.slots[self.slots >= 0].astype(np.int64)

    def _probe(
        self, ids: np.ndarray, spaces: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """For each id, its row (-1 if absent), the slot where its search ended (its own, or
        the empty slot that proved it absent; -1 for every id if the map is empty) and, in a
        map keyed by space, its row's payload (-1 if absent)."""
        if self.num_rows == 0:
            empty = np.full(ids.size, EMPTY, dtype=np.int64)
            keyed = self.row_spaces is not None
            payloads = np.full(ids.size, EMPTY, dtype=np.int32) if keyed else None
            return empty, empty.copy(), payloads
        return native.probe(self.slots, self.records, ids, spaces, HASHING, probing.search)

    def _place(self, ids: np.ndarray, rows: np.ndarray, spaces: np.ndarray | None) -> None:
        """Put absent ``ids`` in the first free slot of their probe sequences."""
        self.num_deleted_slots -= native.place(
            self.slots, ids, rows, spaces, HASHING, probing.place
        )

    def _reserve(self, live: int) -> None:
        """Grow (or clean deleted slots from) the slot array so ``live`` rows fit under the
        load bound."""
        size = self.slots.size
        if live + self.num_deleted_slots <= MAX_LOAD * size:
            return
        size = 16
        while live > REHASH_LOAD * size:
            size *= 2
        old = self.slots
        self.slots = np.full(size, EMPTY, dtype=np.int32)
        self.num_deleted_slots = 0
        self.layout += 1
        native.rehash(old, self.records[: self.used_rows], self.slots, HASHING, self._rebuild)

    def _rebuild(
        self, old_slots: np.ndarray, records: np.ndarray, slots: np.ndarray, _: tuple[int, int]
    ) -> None:
        """:meth:`_reserve`'s rebuild by numpy: the rows of ``old_slots`` placed in
        ``slots`` (the map's new, empty slot array) by :meth:`_build`."""
        assert slots is self.slots
        rows = old_slots[old_slots >= 0].astype(np.int64)  # in slot order: no sorting
        if records.dtype.names is None:  # a record is its id
            self._build(records[rows], rows, None)
        else:
            self._build(records["id"][rows], rows, records["space"][rows])

    def _build(self, ids: np.ndarray, rows: np.ndarray, spaces: np.ndarray | None) -> None:
        """Place ``ids`` in an empty slot array at once, in order of home slot; the few that
        would run past the array's end wrap around through :meth:`_place`."""
        past = probing.place_in_order_of_home(self.slots, ids, rows, spaces, HASHING)
        if past.size:
            self._place(ids[past], rows[past], None if spaces is None else spaces[past])


class FusedIdMap:
    """One id map for several tables (a server's dynamic tables): keys are (table, id). A
    request's ids of every table are searched, and its new ones inserted, in one call each,
    whatever the number of tables.

    Rows are numbered densely from 0 per *row group*: tables of one group share row storage
    (a server's :class:`~paramserver.store.arena.RowArena`), so they share one numbering, and
    each group hands out, frees and reuses its own row numbers. ``groups[t]`` is table ``t``'s
    group; by default each table is a group of its own.

    Inside, an :class:`IdMap` keyed by space holds *entries*; ``entry_rows`` gives each entry's
    row in its group. Not thread-safe: the tables sharing it share one lock.
    """

    def __init__(
        self, num_tables: int, initial_slots: int = 1024, groups: Sequence[int] | None = None
    ):
        self.entries = IdMap(initial_slots, spaces=num_tables)
        self.groups = list(range(num_tables)) if groups is None else list(groups)
        if len(self.groups) != num_tables:
            raise ValueError(f"{len(self.groups)} row groups given for {num_tables} tables")
        self.table_groups = np.array(self.groups, dtype=np.int64)
        num_groups = max(self.groups, default=-1) + 1
        self.used_rows = [0] * num_groups  # row numbers handed out per group (live plus free)
        self.free_rows = [np.empty(0, dtype=np.int64) for _ in range(num_groups)]
        self.num_rows = [0] * num_tables  # live rows per table

    def table(self, space: int) -> TableIds:
        """Table ``space``'s view: the single-table calls of an :class:`IdMap`."""
        return TableIds(self, space)

    @property
    def entry_rows(self) -> np.ndarray:
        """Each entry's row in its table (int32: a table's rows on one server < 2^31), kept
        as the entries' payloads."""
        payloads = self.entries.row_payloads
        assert payloads is not None
        return payloads

    def nbytes(self) -> int:
        free = sum(f.nbytes for f in self.free_rows)
        return self.entries.nbytes() + free

    def find(self, spaces: np.ndarray, ids: Tensor) -> Found:
        """Each id's row in its table (-1: absent), and where its search ended."""
        return self.entries.find_payloads(ids, spaces)  # an entry's payload is its row

    def lookup(self, spaces: np.ndarray, ids: Tensor) -> Tensor:
        return self.find(spaces, ids).rows

    def insert(self, spaces: np.ndarray, ids: Tensor, found: Found | None = None) -> Tensor:
        """Add ``ids`` (unique per table, all absent) of tables ``spaces``; returns each one's
        new row in its table. ``found``: :meth:`find`'s answer for exactly these, if nothing
        was inserted since. Each group hands out its rows table by table, in the ids' order."""
        counts = np.bincount(spaces, minlength=len(self.groups))
        if len(self.used_rows) == 1 and bool((spaces[1:] >= spaces[:-1]).all()):
            # One group, ids already table by table (as a read of several tables gives
            # them): its rows in the ids' order, with no sort.
            rows = self._new_rows(0, spaces.size)
        else:
            order = np.argsort(spaces, kind="stable")
            groups = self.table_groups[spaces[order]]
            rows = np.empty(order.size, dtype=np.int64)
            for group in sorted(set(self.table_groups[counts > 0].tolist())):  # np.unique: slower
                at = order[groups == group] if len(self.used_rows) > 1 else order  # one: all
                rows[at] = self._new_rows(group, at.size)
        for table in np.flatnonzero(counts).tolist():
            self.num_rows[table] += int(counts[table])
        self.entries.insert(ids, found, spaces, rows)
        return torch.from_numpy(rows)

    def remove(self, space: int, ids: Tensor) -> Tensor:
        """Delete table ``space``'s ``ids``; returns their freed rows (absent ids ignored)."""
        entries = self.entries.remove(ids, np.full(ids.numel(), space, dtype=np.int16)).numpy()
        rows = self.entry_rows[entries].astype(np.int64)
        group = self.groups[space]
        self.free_rows[group] = np.concatenate([self.free_rows[group], rows])
        self.num_rows[space] -= rows.size
        return torch.from_numpy(rows)

    def live_rows(self, space: int) -> tuple[Tensor, Tensor]:
        """Table ``space``'s ids and rows, sorted by id."""
        slots = self.entries.slots
        occupied = slots[slots >= 0].astype(np.int64)
        assert self.entries.row_spaces is not None
        occupied = occupied[self.entries.row_spaces[occupied] == space]
        ids = self.entries.row_ids[occupied]
        order = np.argsort(ids, kind="stable")
        rows = self.entry_rows[occupied[order]].astype(np.int64)
        return torch.from_numpy(ids[order]), torch.from_numpy(rows)

    def _new_rows(self, group: int, count: int) -> np.ndarray:
        free = self.free_rows[group]
        reused, self.free_rows[group] = free[:count], free[count:]
        start = self.used_rows[group]
        self.used_rows[group] += count - reused.size
        return np.concatenate([reused, np.arange(start, self.used_rows[group])])


class TableIds:
    """One table's view of a :class:`FusedIdMap`: :class:`IdMap`'s single-table calls."""

    def __init__(self, fused: FusedIdMap, space: int):
        self.fused = fused
        self.space = space

    def _spaces(self, ids: Tensor) -> np.ndarray:
        return np.full(ids.numel(), self.space, dtype=np.int16)

    @property
    def num_rows(self) -> int:
        return self.fused.num_rows[self.space]

    @property
    def used_rows(self) -> int:
        """Row numbers handed out in this table's row group (live plus free)."""
        return self.fused.used_rows[self.fused.groups[self.space]]

    @property
    def group_rows(self) -> int:
        """Live rows of every table of this table's row group."""
        group = self.fused.groups[self.space]
        return sum(n for t, n in enumerate(self.fused.num_rows) if self.fused.groups[t] == group)

    def nbytes(self) -> int:
        """This table's share of the fused map's bytes (by its share of the live rows)."""
        live = sum(self.fused.num_rows)
        return self.fused.nbytes() * self.num_rows // live if live else 0

    def find(self, ids: Tensor) -> Found:
        return self.fused.find(self._spaces(ids), ids)

    def lookup(self, ids: Tensor) -> Tensor:
        return self.fused.lookup(self._spaces(ids), ids)

    def insert(self, ids: Tensor, found: Found | None = None) -> Tensor:
        return self.fused.insert(self._spaces(ids), ids, found)

    def remove(self, ids: Tensor) -> Tensor:
        return self.fused.remove(self.space, ids)

    def live_rows(self) -> tuple[Tensor, Tensor]:
        return self.fused.live_rows(self.space)
