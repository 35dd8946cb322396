"""The trainer's client: routes rows to their servers and makes one fused call per server.

:meth:`PSClient.push_pull` sends every server, in parallel, the gradients it owns from the last
step and the ids it owns for the next one, then reassembles the answers in the caller's order.
Every server is contacted each step, even one owning nothing the batch touched: it holds dense
parameters to return and, in sync mode, counts this trainer in its round.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor
from torch.futures import Future

from paramserver.config import CodecsSection, GradientCodec, ValueCodec
from paramserver.errors import ParamServerError, ServerLostError
from paramserver.futures import in_order, wait_all
from paramserver.sharding import ShardPlan, merge_rows
from paramserver.store.arena import ROW_STEPS
from paramserver.trainer.cache import RowCache
from paramserver.trainer.kept import KeptCalls
from paramserver.trainer.riders import ChiefBuffers, PooledBags
from paramserver.trainer.routes import CallRoutes, Route
from paramserver.trainer.rowstate import RowStates, joined_state
from paramserver.transport import operations as ops
from paramserver.transport.base import Transport
from paramserver.transport.operations import DATA_OPERATIONS, Operation
from paramserver.transport.profiled import ProfiledTransport
from paramserver.transport.stub import ServerStub
from paramserver.wire.caching import rows_sent
from paramserver.wire.compression import Encoded, ErrorFeedback, encode, plain
from paramserver.wire.messages import (
    BagBlock,
    PushPullReply,
    PushPullRequest,
    RowBlock,
    split_state_key,
)
from paramserver.wire.reports import TrainerReport
from paramserver.wire.sizing import PayloadSize, payload_nbytes, payload_size

RowsById = dict[str, tuple[Tensor, Tensor]]

log = logging.getLogger(__name__)


@dataclass
class Traffic:
    """What the data calls would weigh without codecs, and the embedding rows among them (the
    bytes on the wire are in the transport's call profile)."""

    uncompressed_sent: int = 0
    uncompressed_received: int = 0
    row_bytes_received: int = 0


@dataclass(frozen=True)
class PushCodecs:
    """How a trainer encodes what it pushes (servers choose the codecs of what they send)."""

    dense: GradientCodec = "none"
    tables: Mapping[str, ValueCodec] = field(default_factory=dict)  # table -> codec; absent: none
    topk_ratio: float = 0.01

    @classmethod
    def of(cls, codecs: CodecsSection, tables: Iterable[str]) -> PushCodecs:
        return cls(
            codecs.dense_push_codec,
            {name: codecs.codecs_for_table(name)[0] for name in tables},
            codecs.topk_ratio,
        )


@dataclass
class StepPush:
    """A step's gradients, pushed by a call of their own ahead of a later step's in the same
    message (see :meth:`PSClient.push_pull`)."""

    dense: dict[str, Tensor]
    rows: RowsById
    grads_call: int  # the call whose answer they were computed from
    grads_step: int  # their training step


@dataclass
class Pulled:
    dense: dict[str, Tensor] = field(default_factory=dict)
    rows: RowsById = field(default_factory=dict)
    pooled: dict[str, Tensor] = field(default_factory=dict)  # server-pooled sums per table
    call: int = -1  # the number of the call this answers (-1: a pull outside the calls)
    checkpoint_at: int = -1  # the newest checkpoint the servers announced, a call number
    dense_versions: dict[str, int] = field(default_factory=dict)  # of the dense values
    # Asked with pull_state: the state of the rows that take the pending update, the tables
    # whose rules keep the same parts together.
    row_state: list[RowStates] = field(default_factory=list)
    # Asked with pull_dense_state: each dense value's state by part (its rule's slots, and
    # ROW_STEPS: its 0-d count of updates).
    dense_state: dict[str, dict[str, Tensor]] = field(default_factory=dict)


ROUTED_CALLS_KEPT = 2  # gradients ride on the next call, or with prefetch on the one after


class PSClient:
    """Not thread-safe: one client per trainer, one call in flight at a time."""

    def __init__(
        self,
        transport: Transport,
        plan: ShardPlan,
        trainer: int,
        alarm: Future | None = None,
        codecs: PushCodecs | None = None,
        cache_rows: int = 0,
        publish_every: float | None = None,
    ):
        """``alarm``: a future that fails when the job is lost (see :mod:`.heartbeat`); waits
        on calls end at once when it does. ``codecs``: how to encode pushes (default: none);
        dense gradients are encoded with error feedback. ``cache_rows``: rows of each table
        to cache (see :mod:`.cache`; which rows the cache serves is the servers' decision).
        ``publish_every``: the chief of a sync job that publishes marks a call ``publish``
        this often (seconds): every server cuts its change log at that call's round."""
        if transport.num_servers != plan.num_servers:
            raise ParamServerError(
                f"transport reaches {transport.num_servers} servers but the "
                f"plan has {plan.num_servers}"
            )
        # Profiled: the call profile counts the bytes on the wire.
        self.transport = (
            transport if isinstance(transport, ProfiledTransport) else ProfiledTransport(transport)
        )
        self.plan = plan
        self.trainer = trainer
        self.alarm = alarm
        self.codecs = codecs or PushCodecs()
        self.publish_every = publish_every
        self._publish_at = time.monotonic() + (publish_every or 0.0)
        self.feedback = ErrorFeedback()
        self.caches = {
            name: RowCache(cache_rows, spec.dim, spec.dtype)
            for name, spec in plan.tables.items()
            if cache_rows
        }
        self.next_call = 0  # the number of this trainer's next push_pull
        self.kept = KeptCalls(plan.num_servers)
        self.world = transport.world()  # the RPC world the kept calls were last sent to
        self.paused_s = 0.0  # time spent waiting for restarted servers
        self.traffic = Traffic()
        self.pooled = PooledBags(plan)
        # The routes of the last calls' pulls, by call number, and their ids as each server
        # got them: the gradients of those rows go to the same servers, with the same ids.
        self._routes: dict[int, CallRoutes] = {}
        self.buffers: ChiefBuffers | None = None  # the chief's, once it sends them

    def send_buffers(self, buffers: Mapping[str, Tensor]) -> None:
        """Push the buffers of ``buffers`` the plan places (see :class:`ChiefBuffers`)."""
        self.buffers = ChiefBuffers(self.plan, buffers)

    def check_servers(self) -> None:
        """Fail fast if any server was started with a different model or server count."""
        futures = ServerStub(self.transport).fingerprint()
        for server, future in enumerate(futures):
            theirs = future.wait()
            if theirs != self.plan.fingerprint:
                raise ParamServerError(
                    f"server {server} serves a different model or shard plan "
                    f"({theirs} != {self.plan.fingerprint})"
                )

    def push_pull(
        self,
        dense_grads: dict[str, Tensor],
        row_grads: RowsById,
        pull_ids: dict[str, Tensor],
        *,
        pool_bags: dict[str, BagBlock] | None = None,
        pooled_grads: dict[str, tuple[int, Tensor]] | None = None,
        pull_dense: bool = True,
        final: bool = False,
        report: TrainerReport | None = None,
        grads_call: int = -1,
        grads_step: int = -1,
        pull_state: dict[str, Tensor] | None = None,
        pull_dense_state: bool = False,
        earlier: Sequence[StepPush] = (),
    ) -> InFlight:
        """Start one step's fused call to every server; ``wait()`` on the result for the values.

        ``row_grads`` and ``pull_ids`` hold sorted unique ids per table. The answer holds the
        dense values and, per table, ``(ids, rows)`` in the order of ``pull_ids``. Call
        ``wait()`` before starting the next push: a trainer's pushes reach a server in order.
        Row gradients whose ids are the very tensor the answer of call ``grads_call`` holds
        (``Pulled.rows``) go where that call's pull routed them, without routing them again.

        Server-pooled tables: ``pool_bags`` asks for the pooled sums of bags (the answer's
        ``pooled``), and ``pooled_grads`` maps a table to ``(pull_call, gradient of the pooled
        sums)`` for the bags pulled by the call numbered ``pull_call`` (``Pulled.call``).
        ``grads_call``: the call whose answer the gradients were computed from; ``grads_step``:
        their training step where it is not that call's number. ``pull_state``: per table of
        ``pull_ids``, a bool mask of its ids whose rows' optimizer state to answer too
        (``Pulled.row_state``); ``pull_dense_state``: the dense values' state too
        (``Pulled.dense_state``). ``earlier``: steps pushed before this one, each by a call of
        its own, in the same message to each server (``push_pulls``).
        """
        preceding = [self._numbered_push(push) for push in earlier] if earlier else []
        requests = self._numbered(
            dense_grads, row_grads, pull_dense=pull_dense, final=final, report=report,
            grads_call=grads_call, grads_step=grads_step,
            pull_dense_state=pull_dense and pull_dense_state, publish=self._publish_due(),
        )  # fmt: skip
        self.pooled.add_grads(requests, pooled_grads or {}, self._encode_rows)
        if self.buffers is not None:
            self.buffers.add_changed(requests, final)
        pooled_shapes = self.pooled.add_bags(requests, pool_bags) if pool_bags else {}
        return self._start(
            ops.PUSH_PULL, requests, pull_ids, report, requests[0].call, pooled_shapes,
            cached=True, state_masks=pull_state or {}, preceding=preceding,
        )  # fmt: skip

    def _publish_due(self) -> bool:
        """Whether this call marks its round for the change log (see ``publish_every``)."""
        if self.publish_every is None or time.monotonic() < self._publish_at:
            return False
        self._publish_at = time.monotonic() + self.publish_every
        return True

    def _numbered_push(self, push: StepPush) -> list[PushPullRequest]:
        """An earlier step's push, numbered as a call of its own that pulls nothing."""
        return self._numbered(
            push.dense, push.rows, pull_dense=False,
            grads_call=push.grads_call, grads_step=push.grads_step,
        )  # fmt: skip

    def _numbered(
        self, dense_grads: dict[str, Tensor], row_grads: RowsById, **fields: Any
    ) -> list[PushPullRequest]:
        """The next call's request to each server, with its share of the gradients."""
        requests = [
            PushPullRequest(self.trainer, self.next_call, **fields)
            for _ in range(self.plan.num_servers)
        ]
        self.next_call += 1
        self._add_dense_grads(requests, dense_grads)
        self._add_row_grads(requests, row_grads, requests[0].grads_call)
        return requests

    def _add_dense_grads(
        self, requests: list[PushPullRequest], dense_grads: dict[str, Tensor]
    ) -> None:
        codecs = self.codecs
        for name, grad in dense_grads.items():
            requests[self.plan.dense_server[name]].dense_grads[name] = (
                grad
                if codecs.dense == "none"
                else self.feedback.compress(name, grad, codecs.dense, codecs.topk_ratio)
            )

    def _add_row_grads(
        self, requests: list[PushPullRequest], row_grads: RowsById, grads_call: int
    ) -> None:
        pulled = self._routes.get(grads_call)
        blocks = pulled.grads_by_server(row_grads, self._encode_rows) if pulled else None
        if blocks is not None:  # the rows the call pulled, every one: ids as it sent them
            for request, each in zip(requests, blocks, strict=True):
                request.packed_grads = each
            return
        routed = pulled.routes if pulled else {}
        for name, (ids, grads) in row_grads.items():
            route = routed.get(name)
            if route is None or route.ids is not ids:  # rows added since: route them anew
                route = Route.of(self.plan, name, ids)
            for server, (_, part_grads) in route.by_server(grads):
                requests[server].row_grads[name] = RowBlock(
                    route.packed[server], self._encode_rows(name, part_grads)
                )

    def wire_bytes(self) -> tuple[int, int]:
        """Bytes sent and received by this client's data calls so far."""
        return self.transport.profile.bytes_of(*(op.name for op in DATA_OPERATIONS))

    def pull(self, pull_ids: dict[str, Tensor]) -> RowsById:
        """Read rows outside the step (no gradients, no effect on servers' state); read again
        from a server restarted meanwhile."""
        while True:
            requests = [
                PushPullRequest(self.trainer, 0, pull_dense=False)
                for _ in range(self.plan.num_servers)
            ]
            try:
                return self._start(ops.PULL, requests, pull_ids).wait().rows
            except ServerLostError as lost:
                if not self.transport.restarted_since(lost):
                    raise

    def send_again(self) -> list[Future]:
        """After a server was restarted (every process now in a new RPC world): to each
        server, in order, the calls its log does not hold; one future per server, of the
        answer to the newest. A server that took a call already answers it as a repeat,
        taking it once (:mod:`paramserver.server.idempotency`). Called where a call failed
        with the lost server, and before the first call sent into a new world (the restart
        may have been noticed elsewhere: by a checkpoint, say, or not at all)."""
        self.world = self.transport.world()
        return [
            in_order(self.kept.to_send_again(server), functools.partial(self._send_chunk, server))
            for server in range(self.plan.num_servers)
        ]

    def _send_chunk(self, server: int, chunk: list[PushPullRequest]) -> Future:
        """One message of calls sent again; its future's value is ``(reply, size)``, as
        :meth:`_send`'s."""
        nbytes = sum(payload_size(r).nbytes for r in chunk)
        op, message = (ops.PUSH_PULL, chunk[0]) if len(chunk) == 1 else (ops.PUSH_PULLS, chunk)
        return self.transport.call_sized(server, op.name, message, nbytes)

    def _encode_rows(self, table: str, values: Tensor) -> Tensor | Encoded:
        codec = self.codecs.tables.get(table, "none")
        return values if codec == "none" else encode(codec, values)

    def _start(
        self,
        op: Operation,
        requests: list[PushPullRequest],
        pull_ids: dict[str, Tensor],
        report: TrainerReport | None = None,
        call: int = -1,
        pooled_shapes: dict[str, tuple[tuple[int, int], torch.dtype]] | None = None,
        cached: bool = False,
        state_masks: dict[str, Tensor] | None = None,
        preceding: Sequence[list[PushPullRequest]] = (),
    ) -> InFlight:
        """Send ``requests`` (one per server), asking each for its part of ``pull_ids``;
        ``preceding``: calls (a request per server each) that go before them in the same
        message."""
        pulled = CallRoutes.of(self.plan, pull_ids)
        routes, state_masks = pulled.routes, state_masks or {}
        for request, tables in zip(requests, pulled.packed, strict=False):
            request.packed_pulls = tables
        cached_versions = {}
        for name, ids in pull_ids.items():
            route = routes[name]
            if name in state_masks:
                for server, part in enumerate(route.split(state_masks[name])):
                    requests[server].pull_state[name] = part
            cache = self.caches.get(name) if cached else None
            if cache is not None:
                cached_versions[name] = cache.lookup(ids)
                versions = cached_versions[name][1]
                for server, part in enumerate(route.split(versions)):
                    requests[server].pull_versions[name] = part
        if call >= 0:  # a numbered call's pull: its rows' gradients follow
            self._routes[call] = pulled
            for old in [c for c in self._routes if c <= call - ROUTED_CALLS_KEPT]:
                del self._routes[old]
        futures = self._send(op, requests, preceding, report)
        return InFlight(
            self, futures, pull_ids, routes, call, pooled_shapes or {}, cached_versions,
            state_masks,
        )  # fmt: skip

    def _send(
        self,
        op: Operation,
        requests: list[PushPullRequest],
        preceding: Sequence[list[PushPullRequest]],
        report: TrainerReport | None,
    ) -> list[Future[Any]]:
        """One message per server: its request, after its part of the ``preceding`` calls
        (then the message is a ``push_pulls`` call)."""
        messages, nbytes = _measured(requests, preceding, self.traffic)
        if report is not None:
            self._fill_report(report, sum(nbytes))
        if op is ops.PUSH_PULL:
            self.kept.sent(messages)
            if self.transport.world() != self.world:  # a server was restarted meanwhile
                return self.send_again()  # its log lacks kept calls: they go first
        return [
            self.transport.call_sized(server, op.name, message[0], n)
            if len(message) == 1
            else self.transport.call_sized(server, ops.PUSH_PULLS.name, message, n)
            for server, (message, n) in enumerate(zip(messages, nbytes, strict=True))
        ]

    def _fill_report(self, report: TrainerReport, sending: int) -> None:
        """The traffic totals of a leaving call's report (it pulls nothing, so they are final
        once it is sent, with its own ``sending`` bytes)."""
        sent, received = self.wire_bytes()
        report.bytes_sent = sent + sending
        report.bytes_received = received
        report.uncompressed_bytes_sent = self.traffic.uncompressed_sent
        report.uncompressed_bytes_received = self.traffic.uncompressed_received
        report.row_bytes_received = self.traffic.row_bytes_received
        report.cache_hits = sum(c.hits for c in self.caches.values())
        report.cache_lookups = sum(c.lookups for c in self.caches.values())
        report.resent_calls, report.paused_s = self.kept.resent, self.paused_s


def _measured(
    requests: list[PushPullRequest],
    preceding: Sequence[list[PushPullRequest]],
    traffic: Traffic,
) -> tuple[list[list[PushPullRequest]], list[int]]:
    """Each server's message (its part of the ``preceding`` calls, then its request) and its
    bytes as sent; ``traffic`` counts them uncompressed. Each request is measured once: for
    the traffic, the report and the call profile."""
    messages: list[list[PushPullRequest]] = []
    nbytes: list[int] = []
    for server, request in enumerate(requests):
        message = [*(calls[server] for calls in preceding), request] if preceding else [request]
        messages.append(message)
        nbytes.append(0)
        for part in message:
            size = payload_size(part)
            nbytes[-1] += size.nbytes
            traffic.uncompressed_sent += size.uncompressed_nbytes
    return messages, nbytes


class InFlight:
    """A call to every server under way; :meth:`wait` reassembles the answers."""

    def __init__(
        self,
        client: PSClient,
        futures: list[Future],
        pull_ids: dict[str, Tensor],
        routes: dict[str, Route],
        call: int,
        pooled_shapes: dict[str, tuple[tuple[int, int], torch.dtype]],
        cached_versions: dict[str, tuple[Tensor, Tensor]],
        state_masks: dict[str, Tensor] | None = None,
    ):
        self.client = client
        self.futures = futures
        self.pull_ids = pull_ids
        self.routes = routes
        self.call = call  # the call number (-1 for a pull outside the calls)
        self.pooled_shapes = pooled_shapes
        self.cached_versions = cached_versions  # per cached table: its slots, versions sent
        self.state_masks = state_masks or {}  # per table: the rows whose state was asked
        self.result: Pulled | None = None

    def wait(self) -> Pulled:
        """The reassembled answer (computed once; later calls return it again)."""
        if self.result is None:
            self.result = self._assemble()
        return self.result

    def _answers(self) -> list[tuple[PushPullReply, PayloadSize]]:
        """Every server's answer; where a server was lost and restarted meanwhile, the
        answers to this call sent again (:meth:`PSClient.send_again`)."""
        client = self.client
        lost_at: float | None = None
        while True:
            try:
                answers = wait_all(self.futures, client.alarm)
            except ServerLostError as lost:
                lost_at = time.monotonic() if lost_at is None else lost_at
                if self.call < 0 or not client.transport.restarted_since(lost):
                    raise
                log.warning("trainer %d sends call %d again: %s", client.trainer, self.call, lost)
                self.futures = client.send_again()
                continue
            if lost_at is not None:
                client.paused_s += time.monotonic() - lost_at
            return cast(list[tuple[PushPullReply, PayloadSize]], answers)

    def _assemble(self) -> Pulled:
        answers = self._answers()
        replies = [reply for reply, _ in answers]
        self._check(replies)
        traffic = self.client.traffic
        traffic.uncompressed_received += sum(size.uncompressed_nbytes for _, size in answers)
        pulled = Pulled(call=self.call, checkpoint_at=max(r.checkpoint_at for r in replies))
        for server, reply in enumerate(replies):
            pulled.dense.update({name: plain(v) for name, v in reply.dense.items()})
            pulled.dense_versions.update(reply.dense_versions)
            for key, arrived in reply.dense_state.items():
                name, part = split_state_key(key)
                value = plain(arrived)
                value_of = pulled.dense.get(name)
                shape = () if part == ROW_STEPS or value_of is None else tuple(value_of.shape)
                if (
                    name not in reply.dense
                    or value_of is None
                    or not isinstance(value, Tensor)
                    or value.shape != shape
                ):
                    raise ParamServerError(
                        f"server {server} sent a malformed answer: dense state {key!r} is not "
                        "shaped as the dense value it sent"
                    )
                pulled.dense_state.setdefault(name, {})[part] = value
        for name, (shape, dtype) in self.pooled_shapes.items():
            pooled = torch.zeros(shape, dtype=dtype)
            for reply in replies:
                if name in reply.pooled:
                    pooled += plain(reply.pooled[name])
            pulled.pooled[name] = pooled
        row_bytes = 0
        for name, ids in self.pull_ids.items():
            route = self.routes[name]
            as_sent = [reply.rows[name] for reply in replies]
            row_bytes += sum(p.nbytes if type(p) is Tensor else payload_nbytes(p) for p in as_sent)
            parts = [plain(part) for part in as_sent]
            cached = self.cached_versions.get(name)
            if cached is None:
                rows = route.in_caller_order(parts)
            else:
                versions = route.in_caller_order([reply.row_versions[name] for reply in replies])
                rows = self._with_cached_rows(name, ids, torch.cat(parts), *cached, versions)
            pulled.rows[name] = (ids, rows)
        traffic.row_bytes_received += row_bytes
        if self.state_masks:
            pulled.row_state = joined_state(replies, self.state_masks, self.routes)
        return pulled

    def _check(self, replies: list[PushPullReply]) -> None:
        """Refuse a malformed answer; let go of the calls each server's log now holds."""
        for server, reply in enumerate(replies):
            problem = reply.malformed()
            durable = reply.durable_through
            if problem is None and durable is not None and type(durable) is not int:
                problem = f"durable_through is {durable!r}"
            if problem is not None:
                raise ParamServerError(f"server {server} sent a malformed answer: {problem}")
            self.client.kept.release(server, durable)

    def _with_cached_rows(
        self,
        name: str,
        ids: Tensor,
        sent_rows: Tensor,
        slots: Tensor,
        cached: Tensor,
        versions: Tensor,
    ) -> Tensor:
        """Every row of ``ids``: those the servers sent (in server order), the rest from the
        cache; then the cache learns the new rows."""
        cache = self.client.caches[name]
        sent = rows_sent(cached, versions)
        order = self.routes[name].order
        rows = torch.empty(ids.numel(), sent_rows.shape[1], dtype=sent_rows.dtype)
        rows[sent if order is None else order[sent[order]]] = sent_rows
        rows[~sent] = cache.rows_at(slots[~sent])
        cache.update(ids, slots, rows, versions, sent)
        return rows


def gather_state(
    transport: Transport, plan: ShardPlan, with_optimizer: bool = False
) -> dict[str, dict[str, Tensor]]:
    """Every parameter and buffer (and optionally the parameters' optimizer state) assembled
    from all servers.

    Fixed tables come whole, rows in order; dynamic tables are the union of every server's
    rows, sorted by id (``"ids"``).
    """
    shards = [f.wait() for f in ServerStub(transport).export_state(with_optimizer)]
    state: dict[str, dict[str, Tensor]] = {}
    for name, server in [*plan.dense_server.items(), *plan.buffer_server.items()]:
        state[name] = shards[server][name]
    for name, spec in plan.tables.items():
        state[name] = merge_rows([shard[name] for shard in shards])
        if spec.dynamic is None:
            del state[name]["ids"]  # rows 0..N-1, in order
    return state


def to_state_dict(gathered: dict[str, dict[str, Tensor]], plan: ShardPlan) -> dict[str, Tensor]:
    """The user's state_dict entries: each parameter's value, and each dynamic table's ids
    (next to its weight: ``emb.weight`` comes with ``emb.ids``)."""
    state = {name: entry["value"] for name, entry in gathered.items()}
    for name, spec in plan.tables.items():
        if spec.dynamic is not None:
            state[name.removesuffix("weight") + "ids"] = gathered[name]["ids"]
    return state
