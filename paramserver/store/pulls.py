"""Which row each of a trainer's last training reads of a dynamic table handed out: a gradient
computed from a read goes to the row that read handed out, or nowhere (store/dynamic.py says
why)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from paramserver.store.table import Pull

# Pull records per trainer: this step's, the prefetched one, a retry. A record serves every
# push computed from its read (several, where a trainer pulls every few steps) until newer
# reads push it out.
PULLS_KEPT = 3


@dataclass(eq=False)  # records are compared by identity (their tensors have no truth value)
class PullRecord:
    """What one training read of a dynamic table handed out: the row of each id (-1: none)."""

    call: int  # the trainer's call number
    ids: Tensor  # sorted, unique
    rows: Tensor  # -1 also where the row was removed since


class PullRecords:
    """Each trainer's last :data:`PULLS_KEPT` training reads of one table (not thread-safe:
    its table's lock guards it)."""

    def __init__(self) -> None:
        self._by_trainer: dict[int, deque[PullRecord]] = {}

    def record(self, pull: Pull, ids: Tensor, rows: Tensor) -> None:
        """Keep what the read ``pull`` handed out: ``rows`` of ``ids``, kept as they are (not
        copied: the caller gives a read's own tensors, which no one changes)."""
        trainer, call = pull
        records = self._by_trainer.setdefault(trainer, deque(maxlen=PULLS_KEPT))
        records.append(PullRecord(call, ids, rows))

    def rows_at(
        self, ids: Tensor, pull: Pull, current: Callable[[Tensor], Tensor]
    ) -> Tensor | None:
        """The row each of ``ids`` had at the read ``pull`` and still has (-1: none); ids that
        read did not hand out get their ``current`` rows. None: no record of that read."""
        record = self._record(pull)
        if record is None:
            return None
        pulled = record.ids
        if pulled.numel() == ids.numel() and torch.equal(pulled, ids):
            return record.rows
        if pulled.numel() == 0:
            return current(ids)
        at = torch.searchsorted(pulled, ids).clamp_(max=pulled.numel() - 1)
        then = record.rows[at]  # a copy: the record stays as it is
        others = pulled[at] != ids
        if bool(others.any()):  # searched only for these: a prefetch's asked ids are none
            then[others] = current(ids[others])
        return then

    def all_rows_kept(self, pull: Pull) -> bool:
        """Whether every id the read ``pull`` handed out (if it left a record) had a row then
        and keeps it (no -1): each of those ids' row at that read is then its row now, as a
        row leaves an id only by its removal, which strikes it (:meth:`strike`)."""
        record = self._record(pull)
        return record is None or not record.rows.numel() or int(record.rows.numpy().min()) >= 0

    def _record(self, pull: Pull) -> PullRecord | None:
        trainer, call = pull
        records = self._by_trainer.get(trainer)
        return next((r for r in reversed(records or ()) if r.call == call), None)

    def strike(self, removed: Tensor) -> None:
        """Mark ``removed`` rows as gone in every record: their gradients are dropped."""
        records = [record for kept in self._by_trainer.values() for record in kept]
        if not records or removed.numel() == 0:
            return
        removed = removed.sort().values  # sorted once; each record then costs one search
        for record in records:
            at = torch.searchsorted(removed, record.rows).clamp_(max=removed.numel() - 1)
            record.rows[removed[at] == record.rows] = -1
