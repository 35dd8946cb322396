"""A vectorized, collisionless map from int64 ids to row numbers, for dynamic tables.

Open addressing with linear probing over a power-of-two array of ``slots`` (int32 row numbers;
-1 empty, -2 deleted). The keys are not stored in the slots: ``row_ids[row]`` holds each row's
id, so a probe compares ``row_ids[slots[h]]`` with the id. That keeps the map's memory at
4 bytes per slot plus 8 per row (about 13-19 bytes per row at the load factors kept here,
against 24-32 for a slot array of int64 keys and int32 values).

Every operation works on a whole batch of ids with tensor ops: one probe round handles every
id still unresolved, and rounds repeat only as long as the longest probe chain. Inserts into
one slot by several ids of a batch are resolved deterministically (the lowest pending index
wins), so a run is reproducible.

Rows are numbered densely from 0; a deleted row's number is reused by a later insert, so the
storage of an evicted row is reused rather than grown. Not thread-safe: the table's lock guards
it.
"""

from __future__ import annotations

import torch
from torch import Tensor

EMPTY = -1
DELETED = -2
MAX_LOAD = 0.75  # grow the slot array past this load...
REHASH_LOAD = 0.5  # ...to the smallest power of two at or under this one
ROW_GROWTH = 1.15  # row storage grows by this factor, bounding its slack to 15%
_MIX_1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_MIX_2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX_3 = -7723592293110705685  # 0x94D049BB133111EB


def mix64(values: Tensor) -> Tensor:
    """SplitMix64's finalizer on int64 tensors (wrapping arithmetic): a well-spread hash."""
    x = values + _MIX_1
    x = (x ^ _shift_right(x, 30)) * _MIX_2
    x = (x ^ _shift_right(x, 27)) * _MIX_3
    return x ^ _shift_right(x, 31)


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 values (torch's ``>>`` is arithmetic on signed ints)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


class IdMap:
    def __init__(self, initial_slots: int = 1024):
        """``initial_slots`` is rounded up to a power of two; the map grows as needed."""
        size = 1 << max(4, (initial_slots - 1).bit_length())
        self.slots = torch.full((size,), EMPTY, dtype=torch.int32)
        self.row_ids = torch.empty(0, dtype=torch.int64)  # capacity_rows long
        self.used_rows = 0  # row numbers handed out so far (live plus free)
        self.free_rows = torch.empty(0, dtype=torch.int64)  # deleted row numbers, reused first
        self.num_rows = 0  # live rows
        self.num_deleted_slots = 0

    @property
    def capacity_rows(self) -> int:
        """Rows the table's storage must hold: grows by ROW_GROWTH when row numbers run out."""
        return self.row_ids.numel()

    def nbytes(self) -> int:
        return (
            self.slots.numel() * self.slots.element_size()
            + self.row_ids.numel() * self.row_ids.element_size()
            + self.free_rows.numel() * self.free_rows.element_size()
        )

    def _home(self, ids: Tensor) -> Tensor:
        return mix64(ids) & (self.slots.numel() - 1)

    def _probe(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """For each id, its row (-1 if absent) and its slot position (-1 if absent)."""
        rows = torch.full_like(ids, EMPTY)
        positions = torch.full_like(ids, EMPTY)
        if ids.numel() == 0:
            return rows, positions
        mask = self.slots.numel() - 1
        pending = torch.arange(ids.numel())
        where = self._home(ids)
        while pending.numel():
            found = self.slots[where].long()
            live = found >= 0
            hit = live.clone()
            hit[live] = self.row_ids[found[live]] == ids[pending[live]]
            rows[pending[hit]] = found[hit]
            positions[pending[hit]] = where[hit]
            keep = ~(hit | (found == EMPTY))
            pending = pending[keep]
            where = (where[keep] + 1) & mask
        return rows, positions

    def lookup(self, ids: Tensor) -> Tensor:
        """Row of each id, -1 where the id is absent."""
        return self._probe(ids)[0]

    def insert(self, ids: Tensor) -> Tensor:
        """Add ``ids`` (unique, all absent) and return their new rows."""
        count = ids.numel()
        if count == 0:
            return torch.empty(0, dtype=torch.int64)
        self._reserve(self.num_rows + count)
        reused = self.free_rows[:count]
        self.free_rows = self.free_rows[count:]
        fresh = torch.arange(self.used_rows, self.used_rows + count - reused.numel())
        self.used_rows += fresh.numel()
        if self.used_rows > self.row_ids.numel():
            grown = max(self.used_rows, int(self.row_ids.numel() * ROW_GROWTH) + 16)
            row_ids = torch.empty(grown, dtype=torch.int64)
            row_ids[: self.row_ids.numel()] = self.row_ids
            self.row_ids = row_ids
        rows = torch.cat([reused, fresh])
        self.row_ids[rows] = ids
        self._place(ids, rows)
        self.num_rows += count
        return rows

    def _place(self, ids: Tensor, rows: Tensor) -> None:
        mask = self.slots.numel() - 1
        pending = torch.arange(ids.numel())
        where = self._home(ids)
        while pending.numel():
            found = self.slots[where]
            free = (found == EMPTY) | (found == DELETED)
            # Among pending ids that probe the same free slot, the lowest index claims it.
            order = torch.argsort(where, stable=True)
            sorted_where = where[order]
            first = torch.ones_like(sorted_where, dtype=torch.bool)
            first[1:] = sorted_where[1:] != sorted_where[:-1]
            claims = torch.zeros_like(free)
            claims[order] = first
            claims &= free
            claimed_where = where[claims]
            self.num_deleted_slots -= int((self.slots[claimed_where] == DELETED).sum())
            self.slots[claimed_where] = rows[pending[claims]].int()
            keep = ~claims
            pending = pending[keep]
            where = (where[keep] + 1) & mask

    def remove(self, ids: Tensor) -> Tensor:
        """Delete ``ids`` (unique); returns the freed rows (absent ids are ignored)."""
        rows, positions = self._probe(ids)
        present = rows >= 0
        rows, positions = rows[present], positions[present]
        self.slots[positions] = DELETED
        self.num_deleted_slots += rows.numel()
        self.num_rows -= rows.numel()
        self.free_rows = torch.cat([self.free_rows, rows])
        return rows

    def live_rows(self) -> tuple[Tensor, Tensor]:
        """Ids and rows of every live entry, sorted by id."""
        occupied = self.slots[self.slots >= 0].long()
        ids = self.row_ids[occupied]
        order = torch.argsort(ids)
        return ids[order], occupied[order]

    def _reserve(self, live: int) -> None:
        """Grow (or clean deleted slots from) the slot array so ``live`` rows fit under the
        load bound."""
        size = self.slots.numel()
        if live + self.num_deleted_slots <= MAX_LOAD * size:
            return
        size = 16
        while live > REHASH_LOAD * size:
            size *= 2
        ids, rows = self.live_rows()
        self.slots = torch.full((size,), EMPTY, dtype=torch.int32)
        self.num_deleted_slots = 0
        self._place(ids, rows)
