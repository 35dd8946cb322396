"""Linear probing over an id map's slot array (:class:`~paramserver.store.idmap.IdMap`) in
rounds of array operations: the numpy path of the id map's search and placement, which the
compiled loops (:func:`paramserver.native.probe`, :func:`paramserver.native.place`) do one id
at a time where the install built them; and the id map's ways of placing a batch without them.

The slot array is a power of two long, of int32 row numbers (EMPTY, DELETED). An id's probe
sequence starts at its home slot (:func:`home`) and runs on slot by slot, wrapping around; an
id is at the first slot of its sequence holding its row, and absent if an empty slot comes
first. Every function works on a whole batch of ids: one round examines a window of WINDOW
slots for every id still unresolved, so one round nearly always suffices (the id map keeps the
load under a half). Ids of a batch that pick one slot in a round are resolved
deterministically (the lowest index wins), so a run is reproducible.

A row is known by its record (``records``): its id (int64), or, in a map keyed by space, its
id, payload and space side by side, so a probe's reads of them share a cache line.
"""

from __future__ import annotations

import numpy as np

from paramserver.hashing import GOLDEN_GAMMA
from paramserver.native import Probed

EMPTY = -1
DELETED = -2
WINDOW = 8  # slots examined per id in one probe round
_WINDOW_OFFSETS = np.arange(WINDOW)
_SPACE_STRIDE = -7046029254386353131  # spaces' offsets: odd multiples of 2^64/phi
HASHING = (GOLDEN_GAMMA, _SPACE_STRIDE)  # the home slot's hash: multiplier, space stride


def home(
    slots: np.ndarray, ids: np.ndarray, spaces: np.ndarray | None, hashing: tuple[int, int]
) -> np.ndarray:
    """The home slot of each id. Fibonacci hashing: the top bits of id * 2^64/phi (wrapping
    multiply, well spread); a space moves its ids' homes apart (the same id in two tables
    lands elsewhere)."""
    multiplier, space_stride = hashing
    if spaces is not None:
        ids = ids ^ (spaces.astype(np.int64) * np.int64(space_stride))
    bits = slots.size.bit_length() - 1
    return ((ids * np.int64(multiplier)) >> (64 - bits)) & (slots.size - 1)


def _window(slots: np.ndarray, where: np.ndarray) -> np.ndarray:
    return (where[:, None] + _WINDOW_OFFSETS) & (slots.size - 1)


def search(
    slots: np.ndarray,
    records: np.ndarray,
    ids: np.ndarray,
    spaces: np.ndarray | None,
    hashing: tuple[int, int],
) -> Probed:
    """For each id, its row (-1 if absent), the slot where its search ended (its own, or the
    empty slot that proved it absent) and, in a map keyed by space, its row's payload (-1 if
    absent).

    Its home slot settles most ids, so it is looked at alone first; then each round looks at
    a window of WINDOW consecutive slots per unsettled id: wide windows keep the number of
    rounds (each a few array ops) small. A slot's row is read as one record: one random read
    per slot looked at.
    """
    keyed = records.dtype.names is not None
    payloads = np.full(ids.size, EMPTY, dtype=np.int32) if keyed else None
    start = home(slots, ids, spaces, hashing)
    found = slots.take(start)
    match, held = _matches(records, found, ids, spaces)
    rows = np.where(match, found, EMPTY).astype(np.int64)
    if payloads is not None and held is not None:
        np.copyto(payloads, held, where=match)
    positions = np.where(match | (found == EMPTY), start, EMPTY)
    pending = np.flatnonzero(positions == EMPTY)
    where = start[pending] + 1
    while pending.size:
        window = _window(slots, where)
        found = slots.take(window)
        match, held = _matches(
            records, found, ids[pending, None], None if spaces is None else spaces[pending, None]
        )
        stop = match | (found == EMPTY)
        first = stop.argmax(axis=1)[:, None]
        resolved = np.take_along_axis(stop, first, axis=1)[:, 0]
        hit = np.take_along_axis(match, first, axis=1)[:, 0] & resolved
        at = pending[resolved]
        rows[at] = EMPTY
        rows[pending[hit]] = np.take_along_axis(found, first, axis=1)[hit, 0]
        if payloads is not None and held is not None:
            payloads[pending[hit]] = np.take_along_axis(held, first, axis=1)[hit, 0]
        positions[at] = np.take_along_axis(window, first, axis=1)[resolved, 0]
        pending = pending[~resolved]
        where = where[~resolved] + WINDOW
    return rows, positions, payloads


def _matches(
    records: np.ndarray, found: np.ndarray, keys: np.ndarray, spaces: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Which of the slots ``found`` hold the row of their id (``keys``, broadcast against
    ``found``, like ``spaces``), and, in a map keyed by space, the payload of each slot's
    row (meaningful where it matches)."""
    held = records.take(np.maximum(found, 0))
    if records.dtype.names is None:  # a row's record is its id
        return (held == keys) & (found >= 0), None
    assert spaces is not None, "a map keyed by space needs each id's space"
    match = (held["id"] == keys) & (held["space"] == spaces) & (found >= 0)
    return match, held["payload"]


def place(
    slots: np.ndarray,
    ids: np.ndarray,
    rows: np.ndarray,
    spaces: np.ndarray | None,
    hashing: tuple[int, int],
) -> int:
    """Put the ``rows`` of absent ``ids`` in the first free slot of their probe sequences;
    returns how many deleted slots they took. Ids that pick the same slot in a round: the
    lowest index takes it, the others look on from there."""
    reused = 0
    pending = np.arange(ids.size)
    where = home(slots, ids, spaces, hashing)
    while pending.size:
        window = _window(slots, where)
        free = slots[window] < 0
        has_free = free.any(axis=1)
        chosen = window[np.arange(pending.size), free.argmax(axis=1)]
        # Without a free slot in the window, move on to the next window.
        where = np.where(has_free, chosen, (where + WINDOW) & (slots.size - 1))
        candidates = np.flatnonzero(has_free)
        order = candidates[np.argsort(chosen[candidates], kind="stable")]
        sorted_slots = chosen[order]
        winner = np.ones(sorted_slots.size, dtype=bool)
        winner[1:] = sorted_slots[1:] != sorted_slots[:-1]
        claims = order[winner]
        claimed = chosen[claims]
        reused += int((slots[claimed] == DELETED).sum())
        slots[claimed] = rows[pending[claims]]
        keep = np.ones(pending.size, dtype=bool)
        keep[claims] = False
        pending, where = pending[keep], where[keep]
    return reused


def claim_ends(slots: np.ndarray, ends: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Put each new row in the empty slot that ended its id's search (``ends``, from a
    :func:`search` of this slot array), where no other new id ended there too; returns a mask
    of the rows left to place. Correct because slots only turn empty when the array is
    rebuilt: the first empty slot of an id's probe sequence stays first (and a later id that
    finds it taken searches on past it)."""
    if ends.size == 0 or int(ends.min()) < 0:
        return np.ones(rows.size, dtype=bool)  # -1: searched an empty map
    order = np.argsort(ends, kind="stable")
    ordered = ends[order]
    shared = np.zeros(ends.size, dtype=bool)
    shared[1:] = ordered[1:] == ordered[:-1]
    shared[:-1] |= shared[1:]
    left = np.empty(ends.size, dtype=bool)
    left[order] = shared
    left |= slots[ends] != EMPTY
    claim = ~left
    slots[ends[claim]] = rows[claim]
    return left


def place_in_order_of_home(
    slots: np.ndarray,
    ids: np.ndarray,
    rows: np.ndarray,
    spaces: np.ndarray | None,
    hashing: tuple[int, int],
) -> np.ndarray:
    """Place ``ids`` in an empty slot array at once: taken in order of home slot, each goes to
    the first free slot at or after its home, which is a running maximum over them (what
    :func:`place` finds, without its rounds). Returns the indices of the few that would run
    past the array's end, left to place (they wrap around)."""
    start = home(slots, ids, spaces, hashing)
    order = np.argsort(start, kind="stable")
    before = np.arange(order.size)
    slot = np.maximum.accumulate(start[order] - before) + before
    inside = slot < slots.size
    slots[slot[inside]] = rows[order[inside]]
    return order[~inside]
