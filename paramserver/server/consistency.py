"""Consistency policies, membership and idempotency for one server.

``async``: a push is applied on arrival (per-parameter locks make concurrent pushes to the same
rows safe: each is applied whole, none is lost) and answered at once.

``sync``: the pushes of step ``t`` from every trainer still in the round set form round ``t``.
When the last one arrives the round's gradients are averaged (summed in trainer order, so the
result does not depend on arrival order), applied once, and every trainer of the round is
answered with the new values. Waiting is a :class:`torch.futures.Future` per trainer completed
by the call that closes the round: no RPC thread blocks.

Membership: all trainers start in the round set. A push marked ``final`` (the trainer's data has
ended) takes part in its round and then removes the trainer; later rounds aggregate the rest.

Idempotency: a trainer numbers its calls 0, 1, 2, ... and sends them one at a time, so a
server accepts only the next number. ``(trainer, step)`` on this server is applied at most once:
a duplicate of a push still waiting in a round gets that round's answer; a duplicate of an
applied push is answered with current values (its reads validated, its gradients ignored).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.futures import Future

from paramserver.errors import InvalidPushError, ParamServerError, TrainerDepartedError
from paramserver.protocol import (
    BagBlock,
    PooledGrad,
    PushPullReply,
    PushPullRequest,
    RowBlock,
    TrainerReport,
    payload_nbytes,
)
from paramserver.server.shard import ServerShard, bag_grads_to_rows


def completed(value: object) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def failed(error: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future


def chain(source: Future, transform: Callable[[Any], Any]) -> Future:
    """A future of ``transform(source's value)``; an error passes through with its type kept
    (``Future.then`` would wrap it in a RuntimeError)."""
    result: Future = Future()

    def forward(done: Future) -> None:
        try:
            value = transform(done.value())
        except BaseException as error:
            result.set_exception(error)
        else:
            result.set_result(value)

    source.add_done_callback(forward)
    return result


@dataclass
class _Round:
    requests: dict[int, PushPullRequest] = field(default_factory=dict)
    waiters: dict[int, Future] = field(default_factory=dict)
    closing: bool = False  # complete, being applied; stays listed until answered


class Coordinator:
    """Entry point of a server: routes each request through membership, dedup and the policy."""

    def __init__(self, shard: ServerShard, num_trainers: int, mode: str):
        self.shard = shard
        self.mode = mode
        self.num_trainers = num_trainers
        self.members: set[int] = set(range(num_trainers))
        self.left: set[int] = set()
        self.last_step: dict[int, int] = {}
        self.reports: dict[int, TrainerReport] = {}
        # The bags each trainer pulled for server-side pooling, until their gradients come
        # back: (trainer, pull step, table) -> bags.
        self.pool_specs: dict[tuple[int, int, str], BagBlock] = {}
        self._rounds: dict[int, _Round] = {}
        self._all_left: list[Future] = []
        self.lock = threading.Lock()

    # ---- the calls a trainer makes ----

    def push_pull(self, request: PushPullRequest) -> Future:
        """Validate, apply per the consistency mode and answer; never blocks on other calls."""
        try:
            self._check_header(request)
            with self.lock:
                duplicate = request.step <= self.last_step.get(request.trainer, -1)
            if duplicate:
                request.pooled_grads.clear()  # already applied: only the reads are answered
                request.dense_grads.clear()
                request.row_grads.clear()
            else:
                self._expand_pooled_grads(request)
            self.shard.validate(request)
        except ParamServerError as error:
            return failed(error)
        with self.shard.stats.lock:
            self.shard.stats.bytes_received += payload_nbytes(request)
        with self.lock:
            previous = self.last_step.get(request.trainer, -1)
            if request.step <= previous:
                return self._answer_duplicate(request)
            if request.trainer not in self.members:
                return failed(
                    TrainerDepartedError(
                        f"server {self.shard.server}: trainer {request.trainer} already left"
                    )
                )
            # A trainer's calls reach a server one at a time and numbered 0, 1, 2, ...: a gap
            # is a peer's error (and would let one call move every table's clock far ahead).
            if request.step != previous + 1:
                return failed(
                    ParamServerError(
                        f"server {self.shard.server}: trainer {request.trainer} sent step "
                        f"{request.step} after {previous}"
                    )
                )
            spec_keys = [(request.trainer, p.pull_step, n) for n, p in request.pooled_grads.items()]
            if not all(key in self.pool_specs for key in spec_keys):
                return failed(
                    InvalidPushError(
                        "pooled gradients for bags that were already used", server=self.shard.server
                    )
                )
            for key in spec_keys:
                del self.pool_specs[key]
            self.last_step[request.trainer] = request.step
            clock = self.shard.advance_clock(request.step)
            if request.report is not None:
                self.reports[request.trainer] = request.report
            # In sync mode every push after the initial pull joins its round, gradients or
            # not: the round waits for each member's step, whatever this server owns of it.
            joins_round = self.mode == "sync" and request.step > 0
            if joins_round:
                waiter, ready = self._join_round(request)
        if joins_round:
            self._close_rounds(ready)
            return waiter
        try:
            if request.has_grads:
                self.shard.apply(request.dense_grads, request.row_grads, clock, request.trainer)
            return completed(self._answer(request, train=True, clock=clock))
        except Exception as error:  # a server fault: the caller must hear of it
            return failed(error)
        finally:
            if request.final:
                self._leave([request.trainer])

    def pull(self, request: PushPullRequest) -> Future:
        """Answer a read-only request (no gradients); it changes nothing and needs no key."""
        try:
            self._check_header(request)
            if request.has_grads or request.final:
                raise ParamServerError(
                    f"server {self.shard.server}: a pull must carry no gradients; use push_pull"
                )
            self.shard.validate(request)
        except ParamServerError as error:
            return failed(error)
        return completed(self._answer(request, train=False))

    def wait_all_left(self) -> Future:
        """A future completed once every trainer has left."""
        with self.lock:
            if not self.members:
                return completed(None)
            future: Future = Future()
            self._all_left.append(future)
            return future

    def remove_trainer(self, trainer: int) -> None:
        """Take ``trainer`` out of the round set (it failed); its later pushes are refused."""
        self._leave([trainer])

    # ---- internals ----

    def _check_header(self, request: object) -> None:
        """Reject a request whose fields are not of the types the protocol defines."""
        server = self.shard.server
        if type(request) is not PushPullRequest:
            raise ParamServerError(f"server {server}: malformed request {type(request).__name__}")
        if type(request.trainer) is not int or not 0 <= request.trainer < self.num_trainers:
            raise ParamServerError(f"server {server}: unknown trainer {request.trainer!r}")
        if type(request.step) is not int or request.step < 0:
            raise ParamServerError(f"server {server}: bad step {request.step!r}")
        if type(request.final) is not bool or type(request.pull_dense) is not bool:
            raise ParamServerError(f"server {server}: malformed request: flags must be bools")
        for name in ("dense_grads", "row_grads", "pull_rows", "pool_rows", "pooled_grads"):
            value = getattr(request, name)
            if type(value) is not dict or not all(type(k) is str for k in value):
                raise ParamServerError(
                    f"server {server}: malformed request: {name} must map names to values"
                )
        report = request.report
        if report is not None and not (
            type(report) is TrainerReport
            and report.trainer == request.trainer
            and report.is_well_formed()
        ):
            raise ParamServerError(f"server {server}: malformed trainer report")

    def _expand_pooled_grads(self, request: PushPullRequest) -> None:
        """Turn gradients of pooled vectors into row gradients, using the bags this trainer
        pulled; raises InvalidPushError (and changes nothing) if they do not match."""
        for name, pooled in request.pooled_grads.items():
            if type(pooled) is not PooledGrad or type(pooled.pull_step) is not int:
                raise InvalidPushError(
                    "malformed pooled gradient", param=name, server=self.shard.server
                )
            with self.lock:
                spec = self.pool_specs.get((request.trainer, pooled.pull_step, name))
            if spec is None:
                raise InvalidPushError(
                    f"no pooled pull at step {pooled.pull_step} to match",
                    param=name,
                    server=self.shard.server,
                )
            if name in request.row_grads:
                raise InvalidPushError(
                    "both row and pooled gradients", param=name, server=self.shard.server
                )
            table = self.shard.tables[name]
            self.shard.check_tensor(
                name, pooled.grads, (spec.num_bags, table.spec.dim), table.weight.dtype
            )
            request.row_grads[name] = bag_grads_to_rows(spec, pooled.grads)

    def _answer(self, request: PushPullRequest, *, train: bool, clock: int = 0) -> PushPullReply:
        if train and request.pool_rows:
            with self.lock:
                if request.trainer in self.members:  # a leaver's bags will never come back
                    for name, block in request.pool_rows.items():
                        self.pool_specs[(request.trainer, request.step, name)] = block
        reply = self.shard.read(request, train=train, clock=clock)
        with self.shard.stats.lock:
            self.shard.stats.bytes_sent += payload_nbytes(reply)
        return reply

    def _answer_duplicate(self, request: PushPullRequest) -> Future:
        """Called with the lock held."""
        pending = self._rounds.get(request.step)
        if pending is not None and request.trainer in pending.waiters:
            original = pending.waiters[request.trainer]
            return chain(original, lambda reply: reply)
        return completed(self._answer(request, train=False))

    def _join_round(self, request: PushPullRequest) -> tuple[Future, list[tuple[int, _Round]]]:
        """Add ``request`` to its round; returns its waiter and the rounds now complete.
        Called with the lock held; the caller closes the returned rounds after releasing it."""
        round_ = self._rounds.setdefault(request.step, _Round())
        round_.requests[request.trainer] = request
        waiter: Future = Future()
        round_.waiters[request.trainer] = waiter
        return waiter, self._pop_ready_rounds()

    def _pop_ready_rounds(self) -> list[tuple[int, _Round]]:
        """Mark the rounds whose every member has pushed as closing and return them, oldest
        first. Called with the lock held."""
        ready = [
            (step, round_)
            for step, round_ in self._rounds.items()
            if not round_.closing and self.members <= round_.requests.keys()
        ]
        for _, round_ in ready:
            round_.closing = True
        return sorted(ready, key=lambda item: item[0])

    def _close_rounds(self, ready: list[tuple[int, _Round]]) -> None:
        for step, round_ in ready:
            self._close_round(step, round_)

    def _close_round(self, step: int, round_: _Round) -> None:
        """Apply a complete round and answer each of its trainers; every waiter completes,
        with an error if the round could not be applied."""
        trainers = sorted(round_.requests)
        requests = [round_.requests[t] for t in trainers]
        error: Exception | None = None
        try:
            dense, rows = aggregate_mean(requests)
            self.shard.apply(dense, rows, clock=step)
        except Exception as failure:
            error = failure
        leaving = [r.trainer for r in requests if r.final]
        if leaving:
            self._leave(leaving)
        for trainer in trainers:
            waiter = round_.waiters[trainer]
            try:
                if error is not None:
                    raise error
                waiter.set_result(self._answer(round_.requests[trainer], train=True, clock=step))
            except Exception as failure:
                waiter.set_exception(failure)
        with self.lock:
            del self._rounds[step]

    def _leave(self, trainers: list[int]) -> None:
        with self.lock:
            for trainer in trainers:
                self.members.discard(trainer)
                self.left.add(trainer)
            for key in [k for k in self.pool_specs if k[0] in trainers]:
                del self.pool_specs[key]
            ready = self._pop_ready_rounds()
            done = [] if self.members else self._all_left
            if not self.members:
                self._all_left = []
        self._close_rounds(ready)
        for future in done:
            future.set_result(None)


def aggregate_mean(
    requests: list[PushPullRequest],
) -> tuple[dict[str, torch.Tensor], dict[str, RowBlock]]:
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
    rows: dict[str, RowBlock] = {}
    tables = sorted({name for r in requests for name in r.row_grads})
    for name in tables:
        blocks = [r.row_grads[name] for r in requests if name in r.row_grads]
        ids = torch.cat([b.ids for b in blocks])
        values = torch.cat([b.values for b in blocks])
        unique, inverse = torch.unique(ids, return_inverse=True)
        summed = torch.zeros((unique.numel(), values.shape[1]), dtype=values.dtype)
        summed.index_add_(0, inverse, values)
        rows[name] = RowBlock(unique, summed.div_(count))
    return dense, rows
