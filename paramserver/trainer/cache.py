"""A trainer's cache of hot embedding rows with a bounded lag (after HET, VLDB 2022).

Recommendation ids are heavily skewed: a few rows appear in nearly every batch. A trainer keeps
copies of the rows it used most recently, each with the server's version of the row (its count of
applied updates) when fetched. Each step it sends the servers those versions with the ids it
needs; a server sends back a row only if the copy misses more than ``--cache-lag`` updates
(:func:`~paramserver.wire.caching.must_send`, decided there alone), plus the version of every row
the trainer then holds (the cached one, for a row not sent), from which the trainer reads which
rows came (:func:`~paramserver.wire.caching.rows_sent`). Gradients still go to the servers every
step; only reads are saved. Capacity is per table, in rows: past it, the
least recently used rows go, down to 90% of it (so eviction runs once per 10% of turnover).
"""

from __future__ import annotations

import torch
from torch import Tensor

from paramserver.store.growth import grown_rows, with_rows
from paramserver.store.idmap import IdMap

EVICT_TO = 0.9


class RowCache:
    def __init__(self, capacity: int, dim: int, dtype: torch.dtype):
        self.capacity = capacity
        self.slots = IdMap()
        self.rows = torch.empty(0, dim, dtype=dtype)
        self.versions = torch.empty(0, dtype=torch.int64)
        self.last_used = torch.empty(0, dtype=torch.int64)
        self.clock = 0
        self.hits = 0
        self.lookups = 0

    def lookup(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """The slot (-1: not cached) and cached version (-1: none) of each id. The slots stay
        valid until the next :meth:`update`."""
        slots = self.slots.lookup(ids)
        found = slots >= 0
        versions = torch.full_like(slots, -1)
        versions[found] = self.versions[slots[found]]
        return slots, versions

    def rows_at(self, slots: Tensor) -> Tensor:
        return self.rows.index_select(0, slots)

    def update(
        self, ids: Tensor, slots: Tensor, rows: Tensor, versions: Tensor, sent: Tensor
    ) -> None:
        """After a step's pull of ``ids`` (unique; ``slots`` from :meth:`lookup`): keep the
        ``sent`` rows that exist on their server at their new ``versions``, mark every id used,
        evict if over capacity."""
        self.clock += 1
        self.lookups += ids.numel()
        self.hits += int((~sent).sum())
        keep = sent & (versions >= 0)
        gone = sent & (versions < 0) & (slots >= 0)  # evicted on its server since cached
        if bool(gone.any()):
            self.slots.remove(ids[gone])
            slots = torch.where(gone, -1, slots)
        new = keep & (slots < 0)
        if bool(new.any()):
            slots = slots.clone()
            slots[new] = self.slots.insert(ids[new])
            self._fit()
        self.last_used[slots[slots >= 0]] = self.clock
        at = slots[keep]
        self.rows[at] = rows[keep]
        self.versions[at] = versions[keep]
        if self.slots.num_rows > self.capacity:
            live_ids, live = self.slots.live_rows()
            order = torch.argsort(self.last_used[live], stable=True)
            self.slots.remove(live_ids[order[: live_ids.numel() - int(self.capacity * EVICT_TO)]])

    def _fit(self) -> None:
        needed = self.slots.used_rows
        if needed > self.rows.shape[0]:
            size = grown_rows(self.rows.shape[0], needed)
            self.rows = with_rows(self.rows, size)
            self.versions = with_rows(self.versions, size)
            self.last_used = with_rows(self.last_used, size)
