"""One server's coordinator: consistency policies, membership, liveness and idempotency.

``async``: a push is applied on arrival (per-parameter locks make concurrent pushes to the same
rows safe: each is applied whole, none is lost) and answered at once.

``ssp`` (stale synchronous parallel, bound ``s``): pushes are applied on arrival as in async, but
the answer to a trainer's call ``c`` (the values it computes its next step with) waits until
every live trainer has made call ``c - s``: no trainer runs more than ``s`` steps ahead of the
slowest. ``s = 0`` is lock-step without aggregation; async is no bound.

``sync``: the calls numbered ``t`` from every trainer still in the round set form round ``t``.
When the last one arrives the round's gradients are averaged (summed in trainer order, so the
result does not depend on arrival order), applied once, and every trainer of the round is
answered with the new values. Waiting is a :class:`torch.futures.Future` per trainer completed
by the call that closes the round: no RPC thread blocks. Dynamic tables' clock for a round, and
for the initial calls, is their call number (not the highest seen, which depends on arrival order),
so a sync job is reproducible.

Stragglers: with a ``round_deadline``, a sync round open that long closes with the pushes
present (at least ``min_contributors``); a push for a round that closed without it is not
applied (counted as late) and is answered with current values. An SSP wait ends at the deadline
too. Departures: a trainer silent (no call, no heartbeat) for ``trainer_timeout`` seconds, or
whose heartbeats report its loop idle (no batch drawn, no call made or awaited) for the stall
limit, is declared departed: rounds and bounds stop counting it, and its later calls are
refused.
A watchdog thread checks deadlines and silences; it only completes Futures.

Membership: all trainers start in the round set. A push marked ``final`` (the trainer's data has
ended) takes part in its round and then removes the trainer; later rounds aggregate the rest.

Learning rates: an update is applied at the rate its group's schedule gives for the training
step of its gradients (:mod:`paramserver.schedule`): a push's ``grads_step``, or else its
``grads_call``, in async and ssp (its own trainer's step), ``t - 1`` for the round of call
``t`` in sync (every trainer's step ``t - 1``). A schedule that gives no valid factor fails
the push (or the round) with a ConfigError before anything is changed.

Staleness: each answer that trains records how many updates this server had applied; when the
gradients computed from it arrive (``grads_call`` names that call), the updates applied since
are the gradient's staleness (always 0 in sync mode), kept as a histogram.

Idempotency: a trainer numbers its calls 0, 1, 2, ... and sends them one at a time, so a
server accepts only the next number. ``(trainer, call)`` on this server is applied at most once:
a duplicate of a push still waiting in a round gets that round's answer; a duplicate of an
applied push is answered with current values (its reads validated, its gradients ignored). A
repeat of a trainer's newest call is read as that call was, counting nothing again: a trainer
resumed from a checkpoint at call ``k`` starts by repeating call ``k`` (see ``_answer_again``).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from torch.futures import Future

from paramserver.config import CALLS_PER_MESSAGE, ConsistencySettings
from paramserver.errors import InvalidPushError, ParamServerError, TrainerDepartedError
from paramserver.futures import chain, completed, failed
from paramserver.server.ages import GradientAges
from paramserver.server.checkpointing import ServerCheckpoints
from paramserver.server.decoded import DecodedRequest
from paramserver.server.pooling import PooledPulls
from paramserver.server.rounds import Round, SyncRounds, aggregate_mean
from paramserver.server.shard import ServerShard, bag_grads_to_rows
from paramserver.wire.messages import PooledGrad, PushPullReply, PushPullRequest
from paramserver.wire.reports import TrainerReport
from paramserver.wire.sizing import payload_nbytes

WATCHDOG_PERIOD_S = 0.1

log = logging.getLogger(__name__)


@dataclass
class _Held:
    """An SSP answer held back until the slowest live trainer catches up."""

    request: DecodedRequest
    future: Future
    clock: int
    since: float = field(default_factory=time.monotonic)


@dataclass
class LivenessStats:
    late_pushes: int = 0  # sync pushes whose round had closed without them
    short_rounds: int = 0  # rounds closed at their deadline, without every member
    held_answers: int = 0  # SSP answers that had to wait
    held_seconds: float = 0.0
    released_at_deadline: int = 0
    silence_s: dict[int, float] = field(default_factory=dict)  # departed trainer -> silence


class Coordinator:
    """Entry point of a server: routes each request through membership, dedup and the policy."""

    def __init__(self, shard: ServerShard, settings: ConsistencySettings):
        self.shard = shard
        self.mode = settings.mode
        self.num_trainers = settings.num_trainers
        self.ssp_bound = settings.ssp_bound
        self.round_deadline = settings.round_deadline
        self.min_contributors = settings.min_contributors
        self.trainer_timeout = settings.trainer_timeout
        self.stall_limit = settings.stall_limit
        self.max_message_bytes = settings.max_message_bytes
        self.members: set[int] = set(range(settings.num_trainers))
        self.left: set[int] = set()
        self.departed: set[int] = set()
        self.departure_reasons: dict[int, str] = {}
        self.last_call: dict[int, int] = {}
        self.applied_call: dict[int, int] = {}  # each trainer's newest call applied here
        # Silence is counted from a trainer's last call or heartbeat, or, before its first,
        # from the first contact of any trainer (all start together, after the RPC barrier).
        self.last_seen: dict[int, float] = {}
        self._first_contact: float | None = None
        self.reports: dict[int, TrainerReport] = {}
        self.pooled = PooledPulls()
        self.ages = GradientAges()
        self.liveness = LivenessStats()
        self.rounds = SyncRounds(settings.round_deadline, settings.min_contributors)
        self._held: list[_Held] = []
        self._all_left: list[Future] = []
        self.lock = threading.Lock()
        self.checkpoints = ServerCheckpoints(shard, self._members_now, settings.checkpoint_dir)
        self._stopped = threading.Event()
        self._watchdog = _start_watchdog(self)

    def close(self) -> None:
        """Stop the watchdog thread; returns once it has ended. The shard stays readable."""
        self._stopped.set()
        if self._watchdog is not threading.current_thread():
            self._watchdog.join()

    # ---- the calls a trainer makes ----

    def push_pull(self, message: PushPullRequest) -> Future:
        """Validate, apply per the consistency mode and answer; never blocks on other calls.

        The request's path: check and decode it whole (a refusal changes nothing); answer a
        repeat of a call already taken; admit the new call (membership, numbering, clock);
        then, per mode, join its sync round or apply it at once and answer (an SSP answer
        held back until the slowest trainer is within the bound)."""
        try:
            request, received = self._check_and_decode(message)
        except ParamServerError as error:
            return failed(error)
        with self.shard.stats.lock:
            self.shard.stats.bytes_received += received
        repeated = self._answer_repeat(request)
        if repeated is not None:
            return repeated
        with self.lock:
            try:
                clock = self._admit(request)
            except ParamServerError as error:
                return failed(error)
            if self._joins_round(request):
                waiter = self.rounds.join(request)
                ready = self._ready_rounds()
            else:
                waiter = None
        if waiter is not None:
            self._close_rounds(ready)
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
        answered: Future = Future()
        last = len(requests) - 1

        def take(at: int) -> None:  # the next once the last is answered (at once in async)
            taken = self.push_pull(requests[at])
            if at == last:
                taken.add_done_callback(lambda done: _settle(answered, done))
            else:
                taken.add_done_callback(lambda done: _next(done, at + 1))

        def _next(done: Future, at: int) -> None:
            if not _failed(done, answered):
                take(at)

        take(0)
        return answered

    def _check_and_decode(self, request: PushPullRequest) -> tuple[DecodedRequest, int]:
        """Check the request whole and decode its ids and gradients (a repeat's gradients,
        already applied, are dropped first); returns it decoded, and its size on the wire.
        Raises ParamServerError, changing nothing."""
        self.shard.checks.check_header(request, self.num_trainers)
        with self.lock:
            repeat = request.call <= self.last_call.get(request.trainer, -1)
            if request.trainer in self.departed:  # before its contents are looked at
                raise self._departed(request.trainer)
        received = self.shard.checks.check_size(request, self.max_message_bytes)
        if repeat:
            request.drop_gradients()  # already applied: only the reads are answered
        self.shard.checks.decode_request(request)
        self._expand_pooled_grads(request)
        self.shard.checks.validate(request)
        return DecodedRequest.of(request), received

    def _answer_repeat(self, request: DecodedRequest) -> Future | None:
        """The answer to a call this server already took, if it is one: a push still waiting
        in its round gets that round's answer; an applied one is answered with current
        values (the read, outside the lock, changes nothing)."""
        with self.lock:
            if request.call > self.last_call.get(request.trainer, -1):
                return None
            original = self.rounds.waiter(request.trainer, request.call)
        if original is not None:
            return chain(original, lambda reply: reply)
        return completed(self._answer_again(request))

    def _admit(self, request: DecodedRequest) -> int:
        """Take a new call in order (raises why it is refused); returns the table clock it
        runs at. Called with the lock held."""
        refusal = self._refusal(request, self.last_call.get(request.trainer, -1))
        if refusal is not None:
            raise refusal
        self.pooled.use(request.trainer, request.pooled_from)
        self.last_call[request.trainer] = request.call
        self._seen(request.trainer)
        self.ages.forget_before(request.trainer, request.grads_call)
        if request.report is not None:
            self.reports[request.trainer] = request.report
        clock = self.shard.store.advance_clock(request.call)
        if self.mode == "sync" and request.call == 0:
            # Initial reads run at call 0, as round t's run at t. The highest call seen depends
            # on arrival: a faster trainer's call 1 (waiting in round 1) can come before a
            # slower one's call 0. A late call, outside its round, takes the highest call seen.
            return 0
        return clock

    def _joins_round(self, request: DecodedRequest) -> bool:
        """Whether an admitted call joins its sync round. In sync mode every push after the
        initial pull does, gradients or not (the round waits for each member's call,
        whatever this server owns of it), unless its round closed without it: then it is
        late, and its gradients are dropped. Called with the lock held."""
        if self.mode != "sync" or request.call == 0:
            return False
        if not self.rounds.closed(request.call):
            return True
        self.liveness.late_pushes += 1
        self.ages.dropped(request.trainer, request.grads_call)
        request.drop_gradients()
        return False

    def _apply_and_answer(self, request: DecodedRequest, clock: int) -> Future:
        """Async and SSP (and a late or initial sync call): apply the gradients now, then
        answer, under SSP once the slowest live trainer is within the bound."""
        try:
            if request.has_grads:
                self._record_staleness([request])
                pull = (request.trainer, request.grads_call)
                # Its trainer's step, the schedule's: named, or that of the call it read.
                step = request.grads_step if request.grads_step >= 0 else max(request.grads_call, 0)
                self.shard.apply(request.dense_grads, request.row_grads, clock, pull, step)
                self._count_update()
            with self.lock:  # counted for the SSP bound only once applied
                self.applied_call[request.trainer] = request.call
            if self.ssp_bound is not None and not request.final:
                return self._answer_within_bound(request, clock)
            return completed(self._answer(request, train=True, clock=clock))
        except Exception as error:  # a server fault: the caller must hear of it
            return failed(error)
        finally:
            if request.final:
                self._leave([request.trainer])
            elif self.ssp_bound is not None:
                self._release_held()

    def pull(self, request: PushPullRequest) -> Future:
        """Answer a read-only request (no gradients); it changes nothing and needs no key."""
        try:
            self.shard.checks.check_header(request, self.num_trainers)
            if request.has_grads or request.final:
                raise ParamServerError(
                    f"server {self.shard.server}: a pull must carry no gradients; use push_pull"
                )
            self.shard.checks.check_size(request, self.max_message_bytes)
            self.shard.checks.decode_request(request)  # its ids: it carries no gradients
            self.shard.checks.validate(request)
        except ParamServerError as error:
            return failed(error)
        return completed(self._answer(DecodedRequest.of(request), train=False))

    def heartbeat(self, trainer: int, idle_s: float) -> Future:
        """Note that ``trainer`` is alive, its loop idle for ``idle_s`` seconds; answers what
        this server takes it to be (``member``, ``left`` or ``departed: REASON``). A member
        idle past the stall limit is stuck (in its data, say): it is departed now."""
        if type(trainer) is not int or not 0 <= trainer < self.num_trainers:
            return failed(
                ParamServerError(f"server {self.shard.server}: unknown trainer {trainer!r}")
            )
        if type(idle_s) is not float or not 0.0 <= idle_s < float("inf"):
            return failed(ParamServerError(f"server {self.shard.server}: bad idle time"))
        with self.lock:
            if trainer in self.departed:
                return completed(f"departed: {self.departure_reasons[trainer]}")
            self._seen(trainer)  # also after leaving: the chief beats until the job ends
            if trainer in self.left:
                return completed("left")
        if idle_s <= self.stall_limit:
            return completed("member")
        reason = f"it made no progress for {idle_s:.1f} s, stuck in its data or its loop"
        self._leave([trainer], departed=True, reason=reason)
        with self.lock:
            if trainer not in self.departed:  # its final push came first: it left
                return completed("left")
            self.liveness.silence_s[trainer] = idle_s
        log.warning("server %d: trainer %d departed: %s", self.shard.server, trainer, reason)
        return completed(f"departed: {reason}")

    def wait_all_left(self) -> Future:
        """A future completed once every trainer has left."""
        with self.lock:
            if not self.members:
                return completed(None)
            future: Future = Future()
            self._all_left.append(future)
            return future

    def resume_at(self, step: int) -> None:
        """Continue a job saved at ``step``: every trainer's next new call is ``step + 1``
        (a trainer saved at ``step`` first repeats it: see :meth:`_answer_again`)."""
        with self.lock:
            self.last_call = dict.fromkeys(self.members, step)
            self.applied_call = dict(self.last_call)
        self.checkpoints.planned = self.checkpoints.taken_through = step

    def remove_trainer(self, trainer: int, reason: str = "it failed") -> None:
        """Take ``trainer`` out of the job: it counts as departed."""
        self._leave([trainer], departed=True, reason=reason)

    def check_liveness(self, now: float | None = None) -> None:
        """Declare silent trainers departed, close rounds past their deadline and release
        SSP answers whose bound is met or whose deadline passed (the watchdog's tick)."""
        now = time.monotonic() if now is None else now
        with self.lock:
            timeout, first = self.trainer_timeout, self._first_contact
            silent = [
                t
                for t in sorted(self.members)
                if first is not None and now - self.last_seen.get(t, first) > timeout
            ]
            for t in silent:  # how long it had been silent: the detection time
                self.liveness.silence_s[t] = now - self.last_seen.get(t, first or now)
        for t in silent:
            silence = self.liveness.silence_s[t]
            reason = f"silent (no call, no heartbeat) for {silence:.1f} s"
            self._leave([t], departed=True, reason=reason)
        with self.lock:
            ready = self._ready_rounds(now)
        self._close_rounds(ready)
        self._release_held(now)

    def _members_now(self) -> frozenset[int]:
        with self.lock:
            return frozenset(self.members)

    def chief_lost(self) -> str | None:
        """Why the chief trainer, who ends the job, is lost (it departed, or went silent after
        leaving); None while it is not."""
        with self.lock:
            if 0 in self.departed:
                return f"it was declared departed: {self.departure_reasons[0]}"
            seen = self.last_seen.get(0)
            if 0 in self.left and seen is not None:
                silence = time.monotonic() - seen
                if silence > self.trainer_timeout:
                    return f"it went silent for {silence:.1f} s after its last push"
            return None

    def liveness_stats(self) -> dict[str, Any]:
        with self.lock:
            stats = self.liveness
            return {
                "departed": sorted(self.departed),
                "departed_after_silence_s": dict(sorted(stats.silence_s.items())),
                "late_pushes": stats.late_pushes,
                "short_rounds": stats.short_rounds,
                "held_answers": stats.held_answers,
                "held_seconds": stats.held_seconds,
                "released_at_deadline": stats.released_at_deadline,
                "staleness": dict(sorted(self.ages.histogram.items())),
            }

    def staleness_totals(self) -> dict[str, int]:
        """The gradients applied so far and their summed staleness."""
        with self.lock:
            return self.ages.totals()

    # ---- internals ----

    def _seen(self, trainer: int) -> None:
        """Called with the lock held."""
        now = time.monotonic()
        self.last_seen[trainer] = now
        if self._first_contact is None:
            self._first_contact = now

    def _departed(self, trainer: int) -> TrainerDepartedError:
        """Called with the lock held."""
        return TrainerDepartedError(
            f"server {self.shard.server}: trainer {trainer} was declared departed "
            f"({self.departure_reasons[trainer]}); its later calls are refused"
        )

    def _refusal(self, request: DecodedRequest, previous: int) -> ParamServerError | None:
        """Why a new call must be refused, if it must. Called with the lock held."""
        server, trainer = self.shard.server, request.trainer
        if trainer in self.departed:
            return self._departed(trainer)
        if trainer not in self.members:
            return TrainerDepartedError(f"server {server}: trainer {trainer} already left")
        # A trainer's calls reach a server one at a time and numbered 0, 1, 2, ...: a gap
        # is a peer's error (and would let one call move every table's clock far ahead).
        if request.call != previous + 1:
            return ParamServerError(
                f"server {server}: trainer {trainer} sent call {request.call} after {previous}"
            )
        if not self.pooled.all_held(trainer, request.pooled_from):
            return InvalidPushError(
                "pooled gradients for bags that were already used", server=server
            )
        return None

    def _expand_pooled_grads(self, request: PushPullRequest) -> None:
        """Turn gradients of pooled vectors into row gradients, using the bags this trainer
        pulled; raises InvalidPushError (and changes nothing) if they do not match."""
        for name, pooled in request.pooled_grads.items():
            if type(pooled) is not PooledGrad or type(pooled.pull_call) is not int:
                raise InvalidPushError(
                    "malformed pooled gradient", param=name, server=self.shard.server
                )
            with self.lock:
                spec = self.pooled.of(request.trainer, pooled.pull_call, name)
            if spec is None:
                raise InvalidPushError(
                    f"no pooled pull at call {pooled.pull_call} to match",
                    param=name,
                    server=self.shard.server,
                )
            if name in request.row_grads:
                raise InvalidPushError(
                    "both row and pooled gradients", param=name, server=self.shard.server
                )
            grads = self.shard.checks.pooled_grads(name, pooled.grads, spec.num_bags)
            request.row_grads[name] = bag_grads_to_rows(spec, grads)

    def _answer_again(self, request: DecodedRequest) -> PushPullReply:
        """Answer a call already applied with current values, counting nothing again.

        A repeat of the trainer's newest call is read as that call was, for the push to come
        (its bags, staleness and rows are recorded again), and a final one leaves: so a trainer
        resumed at checkpoint ``k`` repeats call ``k``, whose reads the servers' state already
        counted, and continues as if never stopped; one whose data had ended leaves with it.
        """
        with self.lock:
            newest = request.call == self.last_call.get(request.trainer)
            if newest and request.report is not None:
                self.reports[request.trainer] = request.report
        reply = self._answer(request, train=False, again=newest)
        if newest and request.final:
            self._leave([request.trainer])
        return reply

    def _answer(
        self, request: DecodedRequest, *, train: bool, clock: int = 0, again: bool = False
    ) -> PushPullReply:
        """Read what ``request`` asks for; a ``train`` read (or one ``again``: see
        :meth:`_answer_again`) is recorded for the gradients that will come back."""
        if train or again:
            with self.lock:
                if request.trainer in self.members:  # a leaver's pulls will never come back
                    self.ages.read(request.trainer, request.call)
                    self.pooled.pulled(request.trainer, request.call, request.pool_rows)
        reply = self.shard.read(request, train=train, clock=clock, again=again)
        reply.checkpoint_at = self.checkpoints.planned
        with self.shard.stats.lock:
            self.shard.stats.bytes_sent += payload_nbytes(reply)
        return reply

    def _record_staleness(self, requests: list[DecodedRequest]) -> None:
        with self.lock:
            for request in requests:
                self.ages.arrived(request.trainer, request.grads_call)

    def _count_update(self) -> None:
        with self.lock:
            self.ages.updates += 1

    # ---- SSP ----

    def _within_bound(self, call: int) -> bool:
        """Whether every live trainer has made call ``call - s``. Called with the lock held."""
        assert self.ssp_bound is not None
        slowest = min((self.applied_call.get(t, -1) for t in self.members), default=call)
        return slowest >= call - self.ssp_bound

    def _answer_within_bound(self, request: DecodedRequest, clock: int) -> Future:
        with self.lock:
            if not self._within_bound(request.call):
                held = _Held(request, Future(), clock)
                self._held.append(held)
                self.liveness.held_answers += 1
                return held.future
        return completed(self._answer(request, train=True, clock=clock))

    def _release_held(self, now: float | None = None) -> None:
        """Answer the held calls whose bound is now met (or whose deadline passed)."""
        now = time.monotonic() if now is None else now
        deadline = self.round_deadline
        with self.lock:
            if not self._held:
                return
            released, kept = [], []
            for held in self._held:
                if self._within_bound(held.request.call):
                    released.append(held)
                elif deadline is not None and now - held.since >= deadline:
                    released.append(held)
                    self.liveness.released_at_deadline += 1
                else:
                    kept.append(held)
            self._held = kept
            for held in released:
                self.liveness.held_seconds += now - held.since
        for held in released:
            try:
                held.future.set_result(self._answer(held.request, train=True, clock=held.clock))
            except Exception as error:
                held.future.set_exception(error)

    # ---- sync rounds ----

    def _ready_rounds(self, now: float | None = None) -> list[tuple[int, Round]]:
        """Called with the lock held. While an announced checkpoint's snapshot is not taken,
        no later round closes short: the snapshot must see exactly the rounds up to its call."""
        pending = self.checkpoints.pending_snapshot()
        ready, short = self.rounds.pop_ready(self.members, now, pending)
        self.liveness.short_rounds += short
        return ready

    def _close_rounds(self, ready: list[tuple[int, Round]]) -> None:
        for call, round_ in ready:
            self._close_round(call, round_)

    def _close_round(self, call: int, round_: Round) -> None:
        """Apply a complete round and answer each of its trainers; every waiter completes,
        with an error if the round could not be applied."""
        trainers = sorted(round_.requests)
        requests = [round_.requests[t] for t in trainers]
        error: Exception | None = None
        try:
            self._record_staleness([r for r in requests if r.has_grads])
            for request in requests:  # each one's gradients go only to the rows it read
                self.shard.drop_grads_of_replaced_rows(request)
            dense, rows = aggregate_mean(requests)
            # Round ``call`` holds the gradients of step ``call - 1`` (read by call - 1).
            self.shard.apply(dense, rows, clock=call, step=call - 1)
            self._count_update()
        except Exception as failure:
            error = failure
        leaving = [r.trainer for r in requests if r.final]
        if leaving:
            self._leave(leaving)
        # Every answer is read before any is sent: a checkpoint the chief takes once it holds
        # its answer then sees every member's read of this round.
        answers: dict[int, PushPullReply | Exception] = {}
        for trainer in trainers:
            try:
                if error is not None:
                    raise error
                answers[trainer] = self._answer(round_.requests[trainer], train=True, clock=call)
            except Exception as failure:
                answers[trainer] = failure
        for trainer, answer in answers.items():
            waiter = round_.waiters[trainer]
            if isinstance(answer, Exception):
                waiter.set_exception(answer)
            else:
                waiter.set_result(answer)
        with self.lock:
            self.rounds.remove(call)

    def _leave(self, trainers: list[int], *, departed: bool = False, reason: str = "") -> None:
        """Take ``trainers`` out of the rounds and bounds: they left (their data ended) or,
        with ``departed``, were declared departed for ``reason``."""
        with self.lock:
            for trainer in trainers:
                if trainer not in self.members:
                    continue
                self.members.discard(trainer)
                if departed:
                    self.departed.add(trainer)
                    self.departure_reasons[trainer] = reason
                else:
                    self.left.add(trainer)
            gone = set(trainers)
            self.pooled.forget_trainers(gone)
            self.ages.forget_trainers(gone)
            ready = self._ready_rounds()
            done = [] if self.members else self._all_left
            if not self.members:
                self._all_left = []
        self._close_rounds(ready)
        self._release_held()
        self.checkpoints.members_changed()
        for future in done:
            future.set_result(None)


def _failed(done: Future, answered: Future) -> bool:
    """Whether ``done`` failed; if so ``answered`` fails with its error."""
    try:
        done.value()
    except Exception as error:
        answered.set_exception(error)
        return True
    return False


def _settle(answered: Future, done: Future) -> None:
    if not _failed(done, answered):
        answered.set_result(done.value())


def _start_watchdog(coordinator: Coordinator) -> threading.Thread:
    """A daemon thread ticking ``check_liveness``; it holds the coordinator weakly, so it ends
    with it (or on ``close``)."""
    ref = weakref.ref(coordinator)
    stopped = coordinator._stopped

    def watch() -> None:
        while not stopped.wait(WATCHDOG_PERIOD_S):
            target = ref()
            if target is None:
                return
            try:
                target.check_liveness()
            except Exception:  # keep watching: a missed tick is retried at the next
                log.exception("server %d: liveness check failed", target.shard.server)
            del target

    thread = threading.Thread(target=watch, name="paramserver-watchdog", daemon=True)
    thread.start()
    return thread
