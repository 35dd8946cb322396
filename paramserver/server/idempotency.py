"""Idempotency: each trainer's calls are taken once each, in order.

A trainer numbers its calls 0, 1, 2, ... and sends them one at a time, so a server accepts
only the next number. ``(trainer, call)`` on this server is applied at most once: a duplicate
of a push still waiting in a sync round gets that round's answer; a duplicate of an applied
push is answered with current values (its reads validated, its gradients ignored). A repeat of
a trainer's newest call is read as that call was, counting nothing again: a trainer resumed
from a checkpoint at call ``k`` starts by repeating call ``k``
(:meth:`~paramserver.server.coordinator.Coordinator._answer_again`).
"""

from __future__ import annotations

from collections.abc import Iterable


class CallNumbers:
    """Each trainer's newest call taken here (``last_call``) and newest call applied here
    (``applied_call``, what an SSP bound counts). Not thread-safe: the coordinator's lock
    guards it."""

    def __init__(self) -> None:
        self.last_call: dict[int, int] = {}
        self.applied_call: dict[int, int] = {}

    def taken(self, trainer: int, call: int) -> bool:
        """Whether ``trainer``'s ``call`` was taken already: a repeat."""
        return call <= self.last_call.get(trainer, -1)

    def is_newest(self, trainer: int, call: int) -> bool:
        """Whether ``call`` is the newest call taken from ``trainer``."""
        return call == self.last_call.get(trainer)

    def previous(self, trainer: int) -> int:
        """``trainer``'s newest call taken (-1 before its first): its next must be one more."""
        return self.last_call.get(trainer, -1)

    def take(self, trainer: int, call: int) -> None:
        self.last_call[trainer] = call

    def applied(self, trainer: int, call: int) -> None:
        self.applied_call[trainer] = call

    def slowest_applied(self, trainers: Iterable[int], default: int) -> int:
        """The oldest newest-applied call among ``trainers`` (-1 for one with none applied;
        ``default`` if there are no ``trainers``)."""
        return min((self.applied_call.get(t, -1) for t in trainers), default=default)

    def resume_at(self, trainers: Iterable[int], step: int) -> None:
        """Every one of ``trainers`` took and applied call ``step`` (a job resumed from it)."""
        self.last_call = dict.fromkeys(trainers, step)
        self.applied_call = dict(self.last_call)
