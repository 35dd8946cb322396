"""What a dynamic table keeps of ids it has seen but not admitted yet: how many training calls
saw each and when, so that an id becomes a row at its ``min_count``-th call, the same whatever
the order of one step's calls (see :meth:`PendingIds.count_sightings`)."""

from __future__ import annotations

import torch
from torch import Tensor

from paramserver.store.arena import nbytes_of
from paramserver.store.growth import with_rows
from paramserver.store.idmap import IdMap, TableIds


class PendingIds:
    """Ids seen but not admitted, each with its counters (not thread-safe: its table's lock
    guards it)."""

    def __init__(self) -> None:
        self.ids = IdMap(initial_slots=16)
        self.counts = torch.empty(0, dtype=torch.int32)  # training calls that saw it
        self.seen = torch.empty(0, dtype=torch.int64)  # the last step that saw it
        self.latest = torch.empty(0, dtype=torch.int32)  # its calls at that step

    @property
    def num_ids(self) -> int:
        return self.ids.num_rows

    def count_sightings(self, absent: Tensor, clock: int, min_count: int) -> Tensor:
        """Count this call's sighting of ``absent``; return a mask of those admitted: seen in
        ``min_count`` calls counting this one and those of earlier steps (not the other calls
        of step ``clock``, so the reads of one step admit alike in any order). Admitted ids'
        counters are dropped: from now on they are rows."""
        slots = self.ids.lookup(absent)
        new = absent[slots < 0]
        if new.numel():
            self.ids.insert(new)
            self._fit()
            slots = self.ids.lookup(absent)
            fresh = self.ids.lookup(new)
            self.counts[fresh] = 0
            self.seen[fresh] = -1
            self.latest[fresh] = 0
        this_step = self.seen[slots] == clock
        latest = torch.where(this_step, self.latest[slots], 0)
        admitted = self.counts[slots] - latest + 1 >= min_count
        self.counts[slots] += 1
        self.latest[slots] = latest + 1
        self.seen[slots] = clock
        self.ids.remove(absent[admitted])
        return admitted

    def remove(self, ids: Tensor) -> None:
        """Forget ``ids`` (those pending; others are ignored)."""
        if self.ids.num_rows:
            self.ids.remove(ids)

    def expire(self, before: int) -> Tensor:
        """Forget the ids last seen before step ``before``; returns them."""
        if not self.ids.num_rows:
            return torch.empty(0, dtype=torch.int64)
        ids, slots = self.ids.live_rows()
        forgotten = ids[self.seen[slots] < before]
        self.ids.remove(forgotten)
        return forgotten

    def snapshot(
        self, among: Tensor | None = None, rows: TableIds | None = None
    ) -> dict[str, Tensor]:
        """Copies of every pending id (of ``among`` only, where given) and its counters, keyed
        for a table's snapshot; with ``among``, the ids of it neither pending nor with a row
        in ``rows`` (the table's) as ``pending.forgotten``."""
        if among is None:
            ids, slots = self.ids.live_rows()
        else:
            found = self.ids.lookup(among) if self.ids.num_rows else torch.full_like(among, -1)
            ids, slots = among[found >= 0], found[found >= 0]
        entries = {
            "pending.ids": ids,
            "pending.counts": self.counts[slots],
            "pending.seen": self.seen[slots],
            "pending.latest": self.latest[slots],
        }
        if among is not None:
            assert rows is not None
            entries["pending.forgotten"] = among[(found < 0) & (rows.lookup(among) < 0)]
        return entries

    def restore(self, saved: dict[str, Tensor]) -> None:
        """Add the pending ids of ``saved`` (:meth:`snapshot`'s entries) with their counters."""
        pending = saved["pending.ids"]
        if not pending.numel():
            return
        self.ids.insert(pending)
        self._fit()
        slots = self.ids.lookup(pending)
        self.counts[slots] = saved["pending.counts"]
        self.seen[slots] = saved["pending.seen"]
        # Saved before this counter existed: 0, which matters only for a training read at
        # the saved step itself, and a resumed job's first training reads come after it.
        latest = saved.get("pending.latest")
        self.latest[slots] = 0 if latest is None else latest

    def replay(self, saved: dict[str, Tensor]) -> None:
        """Set the counters of the pending ids of ``saved`` (:meth:`snapshot`'s entries),
        adding those not pending, and forget its ``pending.forgotten``: a recovery's replay."""
        forgotten = saved.get("pending.forgotten")
        if forgotten is not None and forgotten.numel():
            self.remove(forgotten)
        pending = saved.get("pending.ids")
        if pending is None or not pending.numel():
            return
        absent = pending[self.ids.lookup(pending) < 0] if self.ids.num_rows else pending
        if absent.numel():
            self.ids.insert(absent)
            self._fit()
        slots = self.ids.lookup(pending)
        self.counts[slots] = saved["pending.counts"]
        self.seen[slots] = saved["pending.seen"]
        self.latest[slots] = saved["pending.latest"]

    def nbytes(self) -> int:
        return nbytes_of(self.counts, self.seen, self.latest) + self.ids.nbytes()

    def _fit(self) -> None:
        capacity = self.ids.capacity_rows
        if self.counts.numel() < capacity:
            self.counts = with_rows(self.counts, capacity)
            self.seen = with_rows(self.seen, capacity)
            self.latest = with_rows(self.latest, capacity)
