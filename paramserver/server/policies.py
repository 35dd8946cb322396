"""The consistency policies: when a server applies a trainer's push, and when it answers.

``async``: a push is applied on arrival (per-parameter locks make concurrent pushes to the same
rows safe: each is applied whole, none is lost) and answered at once.

``ssp`` (stale synchronous parallel, bound ``s``): pushes are applied on arrival as in async, but
the answer to a trainer's call ``c`` (the values it computes its next step with) waits until
every live trainer has made call ``c - s``: no trainer runs more than ``s`` steps ahead of the
slowest. ``s = 0`` is lock-step without aggregation; async is no bound.

``sync``: the calls numbered ``t`` from every trainer still in the round set form round ``t``.
When the last one arrives the round's gradients are averaged (summed in trainer order, so the
result does not depend on arrival order), applied once, and every trainer of the round is
answered with the new values. Dynamic tables' clock for a round, and for the initial calls, is
their call number (not the highest seen, which depends on arrival order), so a sync job is
reproducible. A push marked ``final`` (the trainer's data has ended) takes part in its round
and then removes the trainer; later rounds aggregate the rest.

Stragglers: with a ``round_deadline``, a sync round open that long closes with the pushes
present (at least ``min_contributors``); a push for a round that closed without it is not
applied (counted as late) and is answered with current values. An SSP wait ends at the deadline
too. A departed trainer (:mod:`~paramserver.server.liveness`) is counted by no round or bound.

The coordinator picks one policy for its mode, once (:func:`make_policy`). Waiting is a
:class:`torch.futures.Future` completed by a later call, a departure or the watchdog's tick
(:meth:`AsyncPolicy.catch_up`): no RPC thread blocks. A policy's state is guarded by the
coordinator's lock: the methods that say so are called with it held, the others take it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torch.futures import Future

from paramserver.config import ConsistencySettings
from paramserver.futures import completed
from paramserver.server.applier import Applier
from paramserver.server.checkpointing import ServerCheckpoints
from paramserver.server.decoded import DecodedRequest
from paramserver.server.idempotency import CallNumbers
from paramserver.server.liveness import Liveness
from paramserver.server.rounds import Round, SyncRounds
from paramserver.wire.messages import PushPullReply


@dataclass
class StragglerCounts:
    late_pushes: int = 0  # sync pushes whose round had closed without them
    short_rounds: int = 0  # rounds closed at their deadline, without every member
    held_answers: int = 0  # SSP answers that had to wait
    held_seconds: float = 0.0
    released_at_deadline: int = 0


class AsyncPolicy:
    """``async``: every call applied on arrival and answered at once. The other policies
    change the moments it defines."""

    def __init__(self, applier: Applier):
        self.applier = applier
        self.counts = StragglerCounts()

    def clock_of(self, call: int, clock: int) -> int:
        """The table clock call number ``call`` runs at, ``clock`` being the highest call
        seen. Called with the lock held."""
        return clock

    def join(self, request: DecodedRequest) -> Future | None:
        """The answer an admitted call waits for with other trainers' calls, if it waits (it
        is then applied with them); None: apply it now. Called with the lock held."""
        return None

    def waiting_answer(self, trainer: int, call: int) -> Future | None:
        """The answer a call already taken is still waiting for, if it is. Called with the
        lock held."""
        return None

    def answer(self, request: DecodedRequest, clock: int) -> Future:
        """The answer to a call just applied."""
        return completed(self.applier.answer(request, train=True, clock=clock))

    def catch_up(self, now: float | None = None) -> None:
        """Let go what may go at ``now``: rounds that may close, answers whose bound is met or
        whose deadline passed (after a call, a departure, and at each watchdog tick)."""


@dataclass
class _Held:
    """An SSP answer held back until the slowest live trainer catches up."""

    request: DecodedRequest
    future: Future
    clock: int
    since: float = field(default_factory=time.monotonic)


class SspPolicy(AsyncPolicy):
    """``ssp`` with bound ``settings.ssp_bound``: applied on arrival, each answer held until
    every live trainer is within the bound (or its wait passes ``round_deadline``)."""

    def __init__(
        self,
        applier: Applier,
        settings: ConsistencySettings,
        lock: threading.Lock,
        liveness: Liveness,
        calls: CallNumbers,
    ):
        super().__init__(applier)
        assert settings.ssp_bound is not None
        self.bound = settings.ssp_bound
        self.deadline = settings.round_deadline
        self.lock = lock
        self.liveness = liveness
        self.calls = calls
        self._held: list[_Held] = []

    def answer(self, request: DecodedRequest, clock: int) -> Future:
        if not request.final:  # a trainer that leaves waits for no one
            with self.lock:
                if not self._within_bound(request.call):
                    held = _Held(request, Future(), clock)
                    self._held.append(held)
                    self.counts.held_answers += 1
                    return held.future
        return super().answer(request, clock)

    def catch_up(self, now: float | None = None) -> None:
        """Answer the held calls whose bound is now met (or whose deadline passed)."""
        now = time.monotonic() if now is None else now
        with self.lock:
            released = self._release(now)
        for held in released:
            try:
                held.future.set_result(
                    self.applier.answer(held.request, train=True, clock=held.clock)
                )
            except Exception as error:
                held.future.set_exception(error)

    def _release(self, now: float) -> list[_Held]:
        """Take out the held answers that may go at ``now``. Called with the lock held."""
        released, kept = [], []
        for held in self._held:
            if self._within_bound(held.request.call):
                released.append(held)
            elif self.deadline is not None and now - held.since >= self.deadline:
                released.append(held)
                self.counts.released_at_deadline += 1
            else:
                kept.append(held)
        self._held = kept
        for held in released:
            self.counts.held_seconds += now - held.since
        return released

    def _within_bound(self, call: int) -> bool:
        """Whether every live trainer has made call ``call - s``. Called with the lock held."""
        slowest = self.calls.slowest_applied(self.liveness.members, default=call)
        return slowest >= call - self.bound


class SyncPolicy(AsyncPolicy):
    """``sync``: each call after the initial pull joins its round (:class:`SyncRounds`), which
    is applied once, as its mean, when every member's call is in (or at its deadline)."""

    def __init__(
        self,
        applier: Applier,
        settings: ConsistencySettings,
        lock: threading.Lock,
        liveness: Liveness,
        checkpoints: ServerCheckpoints,
        leave: Callable[[list[int]], None],
    ):
        """``leave(trainers)``: the coordinator's, for the trainers whose data ended."""
        super().__init__(applier)
        self.rounds = SyncRounds(settings.round_deadline, settings.min_contributors)
        self.lock = lock
        self.liveness = liveness
        self.checkpoints = checkpoints
        self.leave = leave

    def clock_of(self, call: int, clock: int) -> int:
        # Initial reads run at call 0, as round t's run at t. The highest call seen depends
        # on arrival: a faster trainer's call 1 (waiting in round 1) can come before a
        # slower one's call 0. A late call, outside its round, takes the highest call seen.
        return 0 if call == 0 else clock

    def join(self, request: DecodedRequest) -> Future | None:
        """Every push after the initial pull joins its round, gradients or not (the round
        waits for each member's call, whatever this server owns of it), unless its round
        closed without it: then it is late, and its gradients are dropped."""
        if request.call == 0:
            return None
        if not self.rounds.closed(request.call):
            return self.rounds.join(request)
        self.counts.late_pushes += 1
        self.applier.drop_late(request)
        return None

    def waiting_answer(self, trainer: int, call: int) -> Future | None:
        return self.rounds.waiter(trainer, call)

    def catch_up(self, now: float | None = None) -> None:
        """Close the rounds that may close. While an announced checkpoint's snapshot is not
        taken, no later round closes short: the snapshot must see exactly the rounds up to
        its call."""
        with self.lock:
            pending = self.checkpoints.pending_snapshot()
            ready, short = self.rounds.pop_ready(self.liveness.members, now, pending)
            self.counts.short_rounds += short
        for call, round_ in ready:
            self._close(call, round_)

    def _close(self, call: int, round_: Round) -> None:
        """Apply a complete round and answer each of its trainers; every waiter completes,
        with an error if the round could not be applied."""
        trainers = sorted(round_.requests)
        requests = [round_.requests[t] for t in trainers]
        error: Exception | None = None
        try:
            self.applier.apply_round(call, requests)
        except Exception as failure:
            error = failure
        leaving = [r.trainer for r in requests if r.final]
        if leaving:
            self.leave(leaving)
        # Every answer is read before any is sent: a checkpoint the chief takes once it holds
        # its answer then sees every member's read of this round.
        answers: dict[int, PushPullReply | Exception] = {}
        for trainer in trainers:
            try:
                if error is not None:
                    raise error
                answers[trainer] = self.applier.answer(
                    round_.requests[trainer], train=True, clock=call
                )
            except Exception as failure:
                answers[trainer] = failure
        if error is None:
            self.applier.round_read(call, requests)
        for trainer, answer in answers.items():
            waiter = round_.waiters[trainer]
            if isinstance(answer, Exception):
                waiter.set_exception(answer)
            else:
                waiter.set_result(answer)
        with self.lock:
            self.rounds.remove(call)


def make_policy(
    settings: ConsistencySettings,
    applier: Applier,
    lock: threading.Lock,
    liveness: Liveness,
    calls: CallNumbers,
    checkpoints: ServerCheckpoints,
    leave: Callable[[list[int]], None],
) -> AsyncPolicy:
    """The policy of ``settings.mode``, over the coordinator's rooms (``lock`` guards them)."""
    if settings.mode == "sync":
        return SyncPolicy(applier, settings, lock, liveness, checkpoints, leave)
    if settings.mode == "ssp":
        return SspPolicy(applier, settings, lock, liveness, calls)
    return AsyncPolicy(applier)
