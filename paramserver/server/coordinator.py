"""One server's coordinator: each trainer's call taken through its stages, room by room.

A call's path: checked whole and decoded (:class:`~paramserver.server.intake.Intake`; a
refusal changes nothing); answered again if this server took it already (idempotency,
:mod:`~paramserver.server.idempotency`); admitted in order (its number, its trainer's
membership, the tables' clock); then applied and answered when the job's consistency policy
says (:mod:`~paramserver.server.policies`), by the
:class:`~paramserver.server.applier.Applier`. Membership, heartbeats and the watchdog are
:mod:`~paramserver.server.liveness`'s; checkpoints, :mod:`~paramserver.server.checkpointing`'s.

One lock, the coordinator's, guards the books of every room (whom it counts, each trainer's
calls, the bags pulled for pooling, the gradients' ages, the trainers' reports, the policy's
rounds and held answers), so that a call is admitted, or a trainer leaves, in one step.
Nothing waits while holding it; waiting is a :class:`torch.futures.Future`, completed later.
"""

from __future__ import annotations

import contextlib
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import asdict
from typing import Any

from torch.futures import Future

from paramserver.changelog.publisher import Publisher
from paramserver.config import CALLS_PER_MESSAGE, ConsistencySettings
from paramserver.errors import InvalidPushError, ParamServerError
from paramserver.futures import chain, completed, failed, in_order
from paramserver.server.ages import GradientAges
from paramserver.server.applier import Applier
from paramserver.server.checkpointing import ServerCheckpoints
from paramserver.server.decoded import DecodedRequest
from paramserver.server.gate import CallGate
from paramserver.server.idempotency import CallNumbers
from paramserver.server.intake import Intake
from paramserver.server.liveness import Liveness, Watchdog
from paramserver.server.policies import make_policy
from paramserver.server.pooling import PooledPulls
from paramserver.server.shard import ServerShard
from paramserver.wire.messages import PushPullReply, PushPullRequest
from paramserver.wire.reports import TrainerReport


class Coordinator:
    """Entry point of a server: routes each request through its checks, idempotency,
    admission and the consistency policy."""

    def __init__(self, shard: ServerShard, settings: ConsistencySettings):
        self.shard = shard
        self.num_trainers = settings.num_trainers
        self.max_message_bytes = settings.max_message_bytes
        self.lock = threading.Lock()  # guards the rooms' books (see the module doc)
        self.liveness = Liveness(shard.server, settings, self.lock, self.remove_trainer)
        self.calls = CallNumbers()
        self.pooled = PooledPulls()
        self.ages = GradientAges()
        self.reports: dict[int, TrainerReport] = {}
        self.checkpoints = ServerCheckpoints(
            shard, self.liveness.members_now, settings.checkpoint_dir
        )
        self.intake = Intake(shard, settings, self.lock, self.liveness, self.calls, self.pooled)
        self.applier = Applier(
            shard, self.lock, self.liveness, self.ages, self.pooled, self.checkpoints
        )
        self.policy = make_policy(
            settings,
            self.applier,
            self.lock,
            self.liveness,
            self.calls,
            self.checkpoints,
            self._leave,
        )
        self._watchdog = Watchdog(self.check_liveness, shard.server)
        # Where an async job's log is cut for recovery: its cuts fall between calls.
        self.gate: CallGate | None = None

    def publish_to(self, publisher: Publisher) -> None:
        """Publish the shard's changes with ``publisher`` (attached to its store) from now on;
        :meth:`close` cuts its last segment."""
        self.applier.publisher = publisher
        self.checkpoints.on_committed = publisher.keep_after
        if self.checkpoints.root is not None:  # until one commits, the base is where it began
            publisher.keep_after(publisher.store.changes.covered())

    def cut_between_calls(self) -> CallGate:
        """The gate that lets a timed cut of the change log, and a checkpoint's snapshot (with
        the books, then), in only between calls (see :mod:`~paramserver.server.gate`); a
        recovering async job's publisher holds its ``cut``."""
        self.gate = CallGate()
        self.checkpoints.between_calls, self.checkpoints.books = self.gate.cut, self.recovery_books
        return self.gate

    def _passing(self) -> AbstractContextManager[Any]:
        return contextlib.nullcontext() if self.gate is None else self.gate.call()

    def close(self) -> None:
        """Stop the watchdog thread and publishing (a last segment cut and written); returns
        once they have ended. The shard stays readable."""
        self._watchdog.stop()
        if self.applier.publisher is not None:
            self.applier.publisher.close()

    # ---- the calls a trainer makes ----

    def push_pull(self, message: PushPullRequest) -> Future:
        """Validate, apply per the consistency mode and answer; never blocks on other calls.

        The request's path: check and decode it whole (a refusal changes nothing); answer a
        repeat of a call already taken; admit the new call (membership, numbering, clock);
        then join the calls it waits for (a sync round) or apply it at once and answer (an SSP
        answer held back until the slowest trainer is within the bound)."""
        try:
            request = self.intake.push_pull(message)
        except ParamServerError as error:
            return failed(error)
        with self._passing():
            repeated = self._answer_repeat(request)
            if repeated is not None:
                return repeated
            with self.lock:
                try:
                    clock = self._admit(request)
                except ParamServerError as error:
                    return failed(error)
                waiter = self.policy.join(request)
            if waiter is not None:
                self.policy.catch_up()  # its round may be complete
                return waiter
            return self._apply_and_answer(request, clock)

    def push_pulls(self, requests: object) -> Future:
        """Several calls of one trainer in one message (a trainer that pulls every few steps
        pushes each step's gradients with a call of its own): each taken as :meth:`push_pull`
        takes it, in order, the next once the last is answered; answers with the last one's
        answer. One refused or failed ends the message there: the calls before it stay
        taken (a retry repeats them harmlessly), those after it are not looked at."""
        if (
            type(requests) is not list
            or not 0 < len(requests) <= CALLS_PER_MESSAGE
            or any(type(r) is not PushPullRequest for r in requests)
        ):
            return failed(
                ParamServerError(
                    f"server {self.shard.server}: push_pulls takes a list of 1 to "
                    f"{CALLS_PER_MESSAGE} requests"
                )
            )
        return in_order(requests, self.push_pull)

    def pull(self, message: PushPullRequest) -> Future:
        """Answer a read-only request (no gradients); it changes nothing and needs no key."""
        try:
            request = self.intake.pull(message)
        except ParamServerError as error:
            return failed(error)
        return completed(self.applier.answer(request, train=False))

    def heartbeat(self, trainer: int, idle_s: float) -> Future:
        """See :meth:`Liveness.heartbeat`."""
        return self.liveness.heartbeat(trainer, idle_s)

    # ---- the job's ----

    def wait_all_left(self) -> Future:
        """A future completed once every trainer has left."""
        return self.liveness.wait_all_left()

    def resume_at(self, step: int) -> None:
        """Continue a job saved at ``step``: every trainer's next new call is ``step + 1``
        (a trainer saved at ``step`` first repeats it: see :meth:`_answer_again`)."""
        with self.lock:
            self.calls.resume_at(self.liveness.members, step)
        self.checkpoints.resume_at(step)

    def recovery_books(self) -> dict[str, Any]:
        """What this server must know, beyond its store, to take each call exactly once after
        a recovery (JSON, for a change log's recovery section): each trainer's newest call
        taken, the trainers that left and those declared departed (with why)."""
        with self.lock:
            return {
                "calls": {str(t): call for t, call in sorted(self.calls.last_call.items())},
                "left": sorted(self.liveness.left),
                "departed": {str(t): why for t, why in sorted(self.liveness.departed.items())},
            }

    def recover_books(self, books: dict[str, Any]) -> None:
        """Take the books of :meth:`recovery_books` (a server recovered from its log): every
        call up to each trainer's newest was taken and applied."""
        calls = {int(t): int(call) for t, call in books["calls"].items()}
        with self.lock:
            self.calls.last_call, self.calls.applied_call = dict(calls), dict(calls)
        if books["left"]:
            self._leave([int(t) for t in books["left"]])
        for trainer, why in books["departed"].items():
            self._leave([int(trainer)], departed=True, reason=why)

    def remove_trainer(self, trainer: int, reason: str = "it failed") -> None:
        """Take ``trainer`` out of the job: it counts as departed."""
        self._leave([trainer], departed=True, reason=reason)

    def check_liveness(self, now: float | None = None) -> None:
        """Declare silent trainers departed, close rounds past their deadline and release
        SSP answers whose bound is met or whose deadline passed (the watchdog's tick)."""
        now = time.monotonic() if now is None else now
        self.liveness.depart_silent(now)
        self.policy.catch_up(now)

    def chief_lost(self) -> str | None:
        """See :meth:`Liveness.chief_lost`."""
        return self.liveness.chief_lost()

    # ---- what it reports ----

    @property
    def last_call(self) -> dict[int, int]:
        """Each trainer's newest call taken here (the live mapping: read it under the lock,
        or once the server is quiet)."""
        return self.calls.last_call

    def departed(self) -> list[int]:
        with self.lock:
            return sorted(self.liveness.departed)

    def stats(self) -> dict[str, Any]:
        """What the coordinator adds to the server's stats: the trainers' last reports, who
        left, and :meth:`liveness_stats`."""
        with self.lock:
            stats: dict[str, Any] = {
                "reports": dict(self.reports),
                "left": sorted(self.liveness.left),
            }
        stats.update(self.liveness_stats())
        return stats

    def liveness_stats(self) -> dict[str, Any]:
        with self.lock:
            return {
                **self.liveness.stats(),
                **asdict(self.policy.counts),
                "staleness": dict(sorted(self.ages.histogram.items())),
            }

    def staleness_totals(self) -> dict[str, int]:
        """The gradients applied so far and their summed staleness."""
        with self.lock:
            return self.ages.totals()

    # ---- the stages of a call ----

    def _answer_repeat(self, request: DecodedRequest) -> Future | None:
        """The answer to a call this server already took, if it is one: a push still waiting
        (in its round) gets that answer; an applied one is answered with current values (the
        read, outside the lock, changes nothing)."""
        with self.lock:
            if not self.calls.taken(request.trainer, request.call):
                return None
            original = self.policy.waiting_answer(request.trainer, request.call)
        if original is not None:
            return chain(original, lambda reply: reply)
        return completed(self._answer_again(request))

    def _admit(self, request: DecodedRequest) -> int:
        """Take a new call in order (raises why it is refused); returns the table clock it
        runs at. Called with the lock held."""
        refusal = self._refusal(request)
        if refusal is not None:
            raise refusal
        self.pooled.use(request.trainer, request.pooled_from)
        self.calls.take(request.trainer, request.call)
        self.liveness.seen(request.trainer)
        self.ages.forget_before(request.trainer, request.grads_call)
        if request.report is not None:
            self.reports[request.trainer] = request.report
        clock = self.shard.store.advance_clock(request.call)
        return self.policy.clock_of(request.call, clock)

    def _refusal(self, request: DecodedRequest) -> ParamServerError | None:
        """Why a new call must be refused, if it must. Called with the lock held."""
        server, trainer = self.shard.server, request.trainer
        refusal = self.liveness.refusal(trainer)
        if refusal is not None:
            return refusal
        # A trainer's calls reach a server one at a time and numbered 0, 1, 2, ...: a gap
        # is a peer's error (and would let one call move every table's clock far ahead).
        previous = self.calls.previous(trainer)
        if request.call != previous + 1:
            return ParamServerError(
                f"server {server}: trainer {trainer} sent call {request.call} after {previous}"
            )
        if not self.pooled.all_held(trainer, request.pooled_from):
            return InvalidPushError(
                "pooled gradients for bags that were already used", server=server
            )
        return None

    def _apply_and_answer(self, request: DecodedRequest, clock: int) -> Future:
        """Apply the call's gradients now, then answer as the policy says (async and ssp;
        a late or initial sync call)."""
        try:
            self.applier.apply(request, clock)
            with self.lock:  # counted for the SSP bound only once applied
                self.calls.applied(request.trainer, request.call)
            return self.policy.answer(request, clock)
        except Exception as error:  # a server fault: the caller must hear of it
            return failed(error)
        finally:
            if request.final:
                self._leave([request.trainer])
            else:
                self.policy.catch_up()

    def _answer_again(self, request: DecodedRequest) -> PushPullReply:
        """Answer a call already applied with current values, counting nothing again.

        A repeat of the trainer's newest call is read as that call was, for the push to come
        (its bags, staleness and rows are recorded again), and a final one leaves: so a trainer
        resumed at checkpoint ``k`` repeats call ``k``, whose reads the servers' state already
        counted, and continues as if never stopped; one whose data had ended leaves with it.
        """
        with self.lock:
            newest = self.calls.is_newest(request.trainer, request.call)
            if newest and request.report is not None:
                self.reports[request.trainer] = request.report
        reply = self.applier.answer(request, train=False, again=newest)
        if newest and request.final:
            self._leave([request.trainer])
        return reply

    def _leave(self, trainers: list[int], *, departed: bool = False, reason: str = "") -> None:
        """Take ``trainers`` out of the rounds and bounds: they left (their data ended) or,
        with ``departed``, were declared departed for ``reason``."""
        with self.lock:
            all_left = self.liveness.remove(trainers, departed=departed, reason=reason)
            gone = set(trainers)
            self.pooled.forget_trainers(gone)
            self.ages.forget_trainers(gone)
        self.policy.catch_up()
        self.checkpoints.members_changed()
        for future in all_left:
            future.set_result(None)
