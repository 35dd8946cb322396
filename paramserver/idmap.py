"""A vectorized, collisionless map from int64 ids to row numbers: the index of a server's dynamic
tables and of a trainer's row cache (a data structure of neither role, so both use it).

Open addressing with linear probing over a power-of-two array of ``slots`` (int32 row numbers;
-1 empty, -2 deleted). The keys are not stored in the slots: ``row_ids[row]`` holds each row's
id, so a probe compares ``row_ids[slots[h]]`` with the id. That keeps the map's memory at
4 bytes per slot plus 8 per row (about 13-19 bytes per row at the load factors kept here,
against 24-32 for a slot array of int64 keys and int32 values).

Every operation works on a whole batch of ids with array ops: one probe round examines a
window of WINDOW slots for every id still unresolved, so one round nearly always suffices.
Inserts into one slot by several ids of a batch are resolved deterministically (the lowest
pending index wins), so a run is reproducible. The arrays are numpy arrays and the calls take
and return torch tensors (shared memory, no copies): a step looks up a few hundred ids per
table, where numpy's per-operation cost is a fraction of torch's.

Rows are numbered densely from 0; a deleted row's number is reused by a later insert, so the
storage of an evicted row is reused rather than grown. Not thread-safe: its owner serializes
calls (a table under its lock; a trainer's cache from the trainer's one loop).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from paramserver.hashing import GOLDEN_GAMMA

EMPTY = -1
DELETED = -2
WINDOW = 8  # slots examined per id in one probe round
_WINDOW_OFFSETS = np.arange(WINDOW)
MAX_LOAD = 0.5  # grow the slot array past this load...
REHASH_LOAD = 0.4  # ...to the smallest power of two at or under this one
ROW_GROWTH = 1.15  # row storage grows by this factor, bounding its slack to 15%


def grown_rows(held: int, needed: int) -> int:
    """The row capacity to grow storage of ``held`` rows to, when ``needed`` rows must fit."""
    return max(needed, int(held * ROW_GROWTH) + 16)


def with_rows(tensor: Tensor, rows: int) -> Tensor:
    """``tensor`` copied into storage of ``rows`` rows; the new rows are uninitialized (their
    owners set every row before it is read)."""
    grown = torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype)
    grown[: tensor.shape[0]] = tensor
    return grown


class Found(NamedTuple):
    """What :meth:`IdMap.find` learned of a batch of ids."""

    rows: Tensor  # row of each id, -1 where absent
    ends: np.ndarray  # slot where each search ended: the id's own, or the empty one that ended it
    layout: int  # the slot array these slots refer to (see IdMap.layout)

    def subset(self, index: Tensor) -> Found:
        return Found(self.rows[index], self.ends[index.numpy()], self.layout)


class IdMap:
    def __init__(self, initial_slots: int = 1024):
        """``initial_slots`` is rounded up to a power of two; the map grows as needed."""
        size = 1 << max(4, (initial_slots - 1).bit_length())
        self.slots = np.full(size, EMPTY, dtype=np.int32)
        self.row_ids = np.empty(0, dtype=np.int64)  # capacity_rows long
        self.used_rows = 0  # row numbers handed out so far (live plus free)
        self.free_rows = np.empty(0, dtype=np.int64)  # deleted row numbers, reused first
        self.num_rows = 0  # live rows
        self.num_deleted_slots = 0
        self.layout = 0  # bumped whenever the slot array is rebuilt

    @property
    def capacity_rows(self) -> int:
        """Rows the table's storage must hold: grows by ROW_GROWTH when row numbers run out."""
        return self.row_ids.size

    def nbytes(self) -> int:
        return self.slots.nbytes + self.row_ids.nbytes + self.free_rows.nbytes

    # ---- calls: torch tensors in and out ----

    def lookup(self, ids: Tensor) -> Tensor:
        """Row of each id, -1 where the id is absent."""
        return torch.from_numpy(self._probe(ids.numpy())[0])

    def find(self, ids: Tensor) -> Found:
        """Like :meth:`lookup`, also remembering where each search ended, so that inserting
        the absent ids right after needs no second search."""
        rows, ends = self._probe(ids.numpy())
        return Found(torch.from_numpy(rows), ends, self.layout)

    def insert(self, ids: Tensor, found: Found | None = None) -> Tensor:
        """Add ``ids`` (unique, all absent) and return their new rows. ``found``: what
        :meth:`find` returned for exactly these ids, if nothing was inserted since."""
        keys = ids.numpy()
        count = keys.size
        if count == 0:
            return torch.empty(0, dtype=torch.int64)
        self._reserve(self.num_rows + count)
        reused = self.free_rows[:count]
        self.free_rows = self.free_rows[count:]
        fresh = np.arange(self.used_rows, self.used_rows + count - reused.size)
        self.used_rows += fresh.size
        if self.used_rows > self.row_ids.size:
            grown = grown_rows(self.row_ids.size, self.used_rows)
            row_ids = np.empty(grown, dtype=np.int64)
            row_ids[: self.row_ids.size] = self.row_ids
            self.row_ids = row_ids
        rows = np.concatenate([reused, fresh])
        self.row_ids[rows] = keys
        if found is None:
            self._place(keys, rows)
        else:
            left = self._claim_ends(found, rows)
            if left.any():
                self._place(keys[left], rows[left])
        self.num_rows += count
        return torch.from_numpy(rows)

    def remove(self, ids: Tensor) -> Tensor:
        """Delete ``ids`` (unique); returns the freed rows (absent ids are ignored)."""
        rows, positions = self._probe(ids.numpy())
        present = rows >= 0
        rows, positions = rows[present], positions[present]
        self.slots[positions] = DELETED
        self.num_deleted_slots += rows.size
        self.num_rows -= rows.size
        self.free_rows = np.concatenate([self.free_rows, rows])
        return torch.from_numpy(rows)

    def live_rows(self) -> tuple[Tensor, Tensor]:
        """Ids and rows of every live entry, sorted by id."""
        ids, rows = self._live()
        return torch.from_numpy(ids), torch.from_numpy(rows)

    # ---- internals, on numpy arrays ----

    def _live(self) -> tuple[np.ndarray, np.ndarray]:
        occupied = self.slots[self.slots >= 0].astype(np.int64)
        ids = self.row_ids[occupied]
        order = np.argsort(ids, kind="stable")
        return ids[order], occupied[order]

    def _home(self, ids: np.ndarray) -> np.ndarray:
        # Fibonacci hashing: the top bits of id * 2^64/phi (wrapping multiply, well spread).
        bits = self.slots.size.bit_length() - 1
        return ((ids * np.int64(GOLDEN_GAMMA)) >> (64 - bits)) & (self.slots.size - 1)

    def _window(self, where: np.ndarray) -> np.ndarray:
        return (where[:, None] + _WINDOW_OFFSETS) & (self.slots.size - 1)

    def _probe(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each id, its row (-1 if absent) and the slot where its search ended: its own,
        or the empty slot that proved it absent (-1 for every id if the map is empty).

        Each round looks at a window of WINDOW consecutive slots per unresolved id: an id is at
        the first slot of its probe sequence holding it, and absent if an empty slot comes
        first. Wide windows keep the number of rounds (each a few array ops) small.
        """
        rows = np.full(ids.size, EMPTY, dtype=np.int64)
        positions = np.full(ids.size, EMPTY, dtype=np.int64)
        if self.num_rows == 0:
            return rows, positions
        pending = np.arange(ids.size)
        keys = ids
        where = self._home(ids)
        while pending.size:
            window = self._window(where)
            found = self.slots[window]
            match = (self.row_ids[np.maximum(found, 0)] == keys[:, None]) & (found >= 0)
            stop = match | (found == EMPTY)
            first = stop.argmax(axis=1)
            each = np.arange(pending.size)
            resolved = stop[each, first]
            hit = match[each, first]
            at = pending[resolved]
            rows[at] = np.where(hit, found[each, first], EMPTY)[resolved]
            positions[at] = window[each, first][resolved]
            unresolved = ~resolved
            pending, keys = pending[unresolved], keys[unresolved]
            where = (where[unresolved] + WINDOW) & (self.slots.size - 1)
        return rows, positions

    def _claim_ends(self, found: Found, rows: np.ndarray) -> np.ndarray:
        """Put each new row in the empty slot that ended its id's search, where the slot array
        is the one searched and no other new id ended there too; returns a mask of the rows
        left to place. Correct because slots only turn empty when the array is rebuilt: the
        first empty slot of an id's probe sequence stays first (and a later id that finds it
        taken searches on past it)."""
        ends = found.ends
        if found.layout != self.layout or ends.size == 0 or int(ends.min()) < 0:
            return np.ones(rows.size, dtype=bool)  # -1: searched an empty map
        order = np.argsort(ends, kind="stable")
        ordered = ends[order]
        shared = np.zeros(ends.size, dtype=bool)
        shared[1:] = ordered[1:] == ordered[:-1]
        shared[:-1] |= shared[1:]
        left = np.empty(ends.size, dtype=bool)
        left[order] = shared
        left |= self.slots[ends] != EMPTY
        claim = ~left
        self.slots[ends[claim]] = rows[claim]
        return left

    def _place(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Put absent ``ids`` in the first free slot of their probe sequences. Ids that pick
        the same slot in a round: the lowest index takes it, the others look on from there."""
        pending = np.arange(ids.size)
        where = self._home(ids)
        while pending.size:
            window = self._window(where)
            free = self.slots[window] < 0
            has_free = free.any(axis=1)
            chosen = window[np.arange(pending.size), free.argmax(axis=1)]
            # Without a free slot in the window, move on to the next window.
            where = np.where(has_free, chosen, (where + WINDOW) & (self.slots.size - 1))
            candidates = np.flatnonzero(has_free)
            order = candidates[np.argsort(chosen[candidates], kind="stable")]
            sorted_slots = chosen[order]
            winner = np.ones(sorted_slots.size, dtype=bool)
            winner[1:] = sorted_slots[1:] != sorted_slots[:-1]
            claims = order[winner]
            claimed = chosen[claims]
            self.num_deleted_slots -= int((self.slots[claimed] == DELETED).sum())
            self.slots[claimed] = rows[pending[claims]]
            keep = np.ones(pending.size, dtype=bool)
            keep[claims] = False
            pending, where = pending[keep], where[keep]

    def _reserve(self, live: int) -> None:
        """Grow (or clean deleted slots from) the slot array so ``live`` rows fit under the
        load bound."""
        size = self.slots.size
        if live + self.num_deleted_slots <= MAX_LOAD * size:
            return
        size = 16
        while live > REHASH_LOAD * size:
            size *= 2
        ids, rows = self._live()
        self.slots = np.full(size, EMPTY, dtype=np.int32)
        self.num_deleted_slots = 0
        self.layout += 1
        self._place(ids, rows)
