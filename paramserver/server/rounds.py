"""Sync-mode rounds: which pushes form round ``t``, when it may close, and its mean.

Round ``t`` collects the calls numbered ``t`` (a trainer's call ``t`` carries the gradients of
its ``t``-th training step) of the trainers in the round set. It may close when every member
has pushed, or, with a deadline, once it has been open that long and holds at least
``min_contributors`` pushes (a short round). Rounds close oldest first; a push for a
round that already closed is late. Not thread-safe: the coordinator's lock guards it.
"""

from __future__ import annotations

import time
from collections.abc import Set
from dataclasses import dataclass, field

import torch
from torch.futures import Future

from paramserver.server.decoded import DecodedRequest, RowGrads


@dataclass
class Round:
    requests: dict[int, DecodedRequest] = field(default_factory=dict)
    waiters: dict[int, Future] = field(default_factory=dict)
    closing: bool = False  # may close, being applied; stays listed until answered
    opened_at: float = field(default_factory=time.monotonic)


class SyncRounds:
    def __init__(self, deadline: float | None, min_contributors: int):
        self.deadline = deadline
        self.min_contributors = min_contributors
        self.open: dict[int, Round] = {}
        self.closed_through = 0  # every round up to this call number has closed

    def closed(self, call: int) -> bool:
        return call <= self.closed_through

    def join(self, request: DecodedRequest) -> Future:
        """Add ``request`` to its round; returns the future of its answer."""
        round_ = self.open.setdefault(request.call, Round())
        round_.requests[request.trainer] = request
        waiter: Future = Future()
        round_.waiters[request.trainer] = waiter
        return waiter

    def waiter(self, trainer: int, call: int) -> Future | None:
        """The answer ``trainer`` awaits for round ``call``, if that round is still open."""
        round_ = self.open.get(call)
        return None if round_ is None else round_.waiters.get(trainer)

    def pop_ready(
        self, members: Set[int], now: float | None = None, short_through: int | None = None
    ) -> tuple[list[tuple[int, Round]], int]:
        """Mark the rounds that may close as closing; returns them, oldest first, and how many
        of them close short (at their deadline, without every member). Rounds past
        ``short_through`` (if given) close only complete."""
        now = time.monotonic() if now is None else now
        ready, short = [], 0
        for call, round_ in self.open.items():
            if round_.closing:
                continue
            if members <= round_.requests.keys():
                ready.append((call, round_))
            elif (
                self.deadline is not None
                and (short_through is None or call <= short_through)
                and now - round_.opened_at >= self.deadline
                and len(round_.requests) >= self.min_contributors
            ):
                ready.append((call, round_))
                short += 1
        for call, round_ in ready:
            round_.closing = True
            self.closed_through = max(self.closed_through, call)
        return sorted(ready, key=lambda item: item[0]), short

    def remove(self, call: int) -> None:
        del self.open[call]


def aggregate_mean(
    requests: list[DecodedRequest],
) -> tuple[dict[str, torch.Tensor], dict[str, RowGrads]]:
    """The mean of the requests' gradients, summed in the order given.

    Every request counts in the denominator, including those that did not touch a parameter or a
    row: the mean gradient of the global batch, where the others contributed zero.
    """
    count = len(requests)
    dense: dict[str, torch.Tensor] = {}
    for request in requests:
        for name, grad in request.dense_grads.items():
            if name in dense:
                dense[name] += grad
            else:
                dense[name] = grad.clone()
    for total in dense.values():
        total.div_(count)
    rows: dict[str, RowGrads] = {}
    tables = sorted({name for r in requests for name in r.row_grads})
    for name in tables:
        blocks = [r.row_grads[name] for r in requests if name in r.row_grads]
        if len(blocks) == 1:
            # One push's ids are sorted and unique already (validated): nothing to merge. Adding
            # 0.0 is what summing into zeros does (-0.0 becomes 0.0), so the bits are the same.
            only = blocks[0]
            rows[name] = RowGrads(only.ids, only.values.add(0.0).div_(count))
            continue
        ids = torch.cat([b.ids for b in blocks])
        values = torch.cat([b.values for b in blocks])
        unique, inverse = torch.unique(ids, return_inverse=True)
        summed = torch.zeros((unique.numel(), values.shape[1]), dtype=values.dtype)
        summed.index_add_(0, inverse, values)
        rows[name] = RowGrads(unique, summed.div_(count))
    return dense, rows
