"""A vectorized, collisionless map from int64 ids to row numbers, for dynamic tables.

Open addressing with linear probing over a power-of-two array of ``slots`` (int32 row numbers;
-1 empty, -2 deleted). The keys are not stored in the slots: ``row_ids[row]`` holds each row's
id, so a probe compares ``row_ids[slots[h]]`` with the id. That keeps the map's memory at
4 bytes per slot plus 8 per row (about 13-19 bytes per row at the load factors kept here,
against 24-32 for a slot array of int64 keys and int32 values).

Every operation works on a whole batch of ids with tensor ops: one probe round examines a
window of 32 slots for every id still unresolved, so one round nearly always suffices. Inserts into
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
WINDOW = 8  # slots examined per id in one probe round
_WINDOW_OFFSETS = torch.arange(WINDOW)
MAX_LOAD = 0.5  # grow the slot array past this load...
REHASH_LOAD = 0.4  # ...to the smallest power of two at or under this one
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
        # Fibonacci hashing: the top bits of id * 2^64/phi (two tensor ops, well spread).
        bits = self.slots.numel().bit_length() - 1
        return ((ids * _MIX_1) >> (64 - bits)) & (self.slots.numel() - 1)

    def _window(self, where: Tensor) -> Tensor:
        return (where.unsqueeze(1) + _WINDOW_OFFSETS) & (self.slots.numel() - 1)

    def _probe(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """For each id, its row (-1 if absent) and its slot position (-1 if absent).

        Each round looks at a window of WINDOW consecutive slots per unresolved id: an id is at
        the first slot of its probe sequence holding it, and absent if an empty slot comes
        first. Wide windows keep the number of rounds (each a few tensor ops) small.
        """
        rows = torch.full_like(ids, EMPTY)
        positions = torch.full_like(ids, EMPTY)
        if self.num_rows == 0:
            return rows, positions
        pending = torch.arange(ids.numel())
        where = self._home(ids)
        while pending.numel():
            window = self._window(where)
            found = self.slots.index_select(0, window.view(-1)).view_as(window).long()
            keys = self.row_ids.index_select(0, found.clamp(min=0).view(-1)).view_as(found)
            match = (keys == ids[pending].unsqueeze(1)) & (found >= 0)
            stop = match | (found == EMPTY)
            first = stop.to(torch.int8).argmax(dim=1, keepdim=True)
            resolved = stop.gather(1, first).squeeze(1)
            hit = match.gather(1, first).squeeze(1)
            at_row = torch.where(hit, found.gather(1, first).squeeze(1), EMPTY)
            at_slot = torch.where(hit, window.gather(1, first).squeeze(1), EMPTY)
            if bool(resolved.all()):  # the usual case: one round settles every id
                if pending.numel() == ids.numel():
                    return at_row, at_slot
                rows[pending], positions[pending] = at_row, at_slot
                break
            rows[pending[resolved]] = at_row[resolved]
            positions[pending[resolved]] = at_slot[resolved]
            pending = pending[~resolved]
            where = (where[~resolved] + WINDOW) & (self.slots.numel() - 1)
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
        """Put absent ``ids`` in the first free slot of their probe sequences. Ids that pick
        the same slot in a round: the lowest index takes it, the others look on from there."""
        pending = torch.arange(ids.numel())
        where = self._home(ids)
        while pending.numel():
            window = self._window(where)
            free = self.slots.index_select(0, window.view(-1)).view_as(window) < 0
            has_free = free.any(dim=1)
            first = free.to(torch.int8).argmax(dim=1, keepdim=True)
            chosen = window.gather(1, first).squeeze(1)
            if bool(has_free.all()) and torch.unique(chosen).numel() == chosen.numel():
                # The usual case: every id found its own free slot in the first window.
                self.num_deleted_slots -= int((self.slots[chosen] == DELETED).sum())
                self.slots[chosen] = rows[pending].int()
                return
            # Without a free slot in the window, move on to the next window.
            where = torch.where(has_free, chosen, (where + WINDOW) & (self.slots.numel() - 1))
            candidates = has_free.nonzero().squeeze(1)
            order = candidates[torch.argsort(chosen[candidates], stable=True)]
            sorted_slots = chosen[order]
            winner = torch.ones_like(sorted_slots, dtype=torch.bool)
            winner[1:] = sorted_slots[1:] != sorted_slots[:-1]
            claims = order[winner]
            claimed = chosen[claims]
            self.num_deleted_slots -= int((self.slots[claimed] == DELETED).sum())
            self.slots[claimed] = rows[pending[claims]].int()
            keep = torch.ones(pending.numel(), dtype=torch.bool)
            keep[claims] = False
            pending = pending[keep]
            where = where[keep]

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
