"""A server's shard: the adapter from messages to the store.

The parameters themselves (dense values, table rows, their optimizer state and locks) are the
server's :class:`~paramserver.store.store.Store`, which knows no wire. Here a request's
gradients are applied and its reads answered: rows a trainer's cache still holds are left out
(``must_send``), replies encoded with the pull codecs, bags pooled, and the call counted.

Thread-safety: every method may be called from many RPC threads at once (the store's locks,
and :class:`ServerStats`'s); none blocks waiting for another call (waiting is done by the
consistency policy's Futures).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from paramserver.config import ShardSettings
from paramserver.errors import ParamServerError
from paramserver.observe import peak_rss_bytes
from paramserver.observe.consistency import checksum
from paramserver.server.decoded import DecodedRequest, RowGrads
from paramserver.server.requests import RequestChecks
from paramserver.sharding import ShardPlan
from paramserver.store.arena import ROW_HELD, ROW_STEPS
from paramserver.store.store import Store
from paramserver.store.table import Pull, ReadAsks, Reading, StateRead
from paramserver.tableinit import RowInit
from paramserver.wire.caching import must_send
from paramserver.wire.compression import Encoded, encode
from paramserver.wire.messages import (
    BagBlock,
    PushPullReply,
    RowBlock,
    RowStateBlock,
    ServerView,
    split_state_key,
    state_key,
)


@dataclass
class ServerStats:
    pushes: int = 0
    rows_updated: int = 0
    rows_pulled: int = 0
    update_seconds: float = 0.0
    read_seconds: float = 0.0
    bytes_received: int = 0
    bytes_sent: int = 0
    # Where this process was restarted after its server died: how it was rebuilt
    # (paramserver.launch.roles.recover_server).
    recovery: dict[str, Any] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def as_dict(self) -> dict[str, float]:
        with self.lock:
            return {
                "pushes": self.pushes,
                "rows_updated": self.rows_updated,
                "rows_pulled": self.rows_pulled,
                "update_seconds": self.update_seconds,
                "read_seconds": self.read_seconds,
                "max_rss_bytes": peak_rss_bytes(),  # of this whole process
                "bytes_received": self.bytes_received,
                "bytes_sent": self.bytes_sent,
            }


def bag_grads_to_rows(block: BagBlock, grads: Tensor) -> RowBlock:
    """Row gradients from the gradient of pooled sums: each id gets its bags' gradients
    (times its weight), summed over its occurrences."""
    members = grads[block.bags]
    if block.weights is not None:
        members = members * block.weights.unsqueeze(1)
    unique, inverse = block.distinct
    summed = torch.zeros(unique.numel(), grads.shape[1], dtype=grads.dtype)
    return RowBlock(unique, summed.index_add_(0, inverse, members))


class ServerShard:
    """Server ``server``'s part of the model (a :class:`~paramserver.store.store.Store`), and
    its calls in the wire's terms: requests applied and answered, replies encoded."""

    def __init__(
        self,
        server: int,
        plan: ShardPlan,
        dense: Mapping[str, Tensor],
        table_inits: Mapping[str, RowInit],
        settings: ShardSettings,
    ):
        """``dense`` and ``table_inits`` as :class:`~paramserver.store.store.Store` takes
        them; ``settings``: each parameter's update rule, the pull codecs and the cache lag."""
        self.server = server
        self.plan = plan
        self.stats = ServerStats()
        self.cache_lag = settings.cache_lag
        self.store = Store(
            server, plan, dense, table_inits, settings.dense_rule, settings.table_rules,
            self.cache_lag,
        )  # fmt: skip
        self.dense_pull_codec = settings.dense_pull_codec
        self.table_pull_codecs = dict(settings.table_pull_codecs)
        self.checks = RequestChecks(
            server, plan, self.store.dense, self.store.tables, self.cache_lag
        )

    # ---- applying and reading ----

    @torch.no_grad()
    def apply(
        self,
        dense_grads: Mapping[str, Tensor],
        row_grads: Mapping[str, RowGrads],
        clock: int = 0,
        pull: Pull | None = None,
        step: int = 0,
    ) -> None:
        """Apply a validated request's gradients (decoded: :class:`DecodedRequest`'s).

        ``pull``: the (trainer, call) whose answer the gradients were computed from (None for
        a sync round's sum, checked by :meth:`drop_grads_of_replaced_rows` first), so dynamic
        tables apply them only to the rows that call read. ``step``: the gradients' training
        step, whose learning rate each group's schedule gives (a schedule that gives none
        raises ConfigError before anything is changed).
        """
        start = time.perf_counter()
        dense_lr, table_lrs = self.store.learning_rates(step, dense_grads, row_grads)
        if dense_grads:
            self.store.apply_dense(dense_grads, dense_lr)
        rows = self.store.apply_rows(row_grads, table_lrs, clock, pull) if row_grads else 0
        with self.stats.lock:
            self.stats.pushes += 1
            self.stats.rows_updated += rows
            self.stats.update_seconds += time.perf_counter() - start

    def drop_grads_of_replaced_rows(self, request: DecodedRequest) -> None:
        """Drop the row gradients of ``request`` whose rows dynamic tables removed since its
        call ``grads_call`` read them (before a sync round sums several trainers' gradients)."""
        pull = (request.trainer, request.grads_call)
        for name, (ids, values) in request.row_grads.items():
            kept = self.store.rows_still_pulled(name, ids, pull)
            if kept is not None and not bool(kept.all()):
                request.row_grads[name] = RowGrads(ids[kept], values[kept])

    def read(
        self, request: DecodedRequest, *, train: bool, clock: int = 0, again: bool = False
    ) -> PushPullReply:
        """Snapshot the values ``request`` asks for (copies, owned by the caller).

        ``train`` reads may create rows of dynamic tables (and count toward admission);
        other reads create and count nothing. A ``train`` read, or one ``again`` (the read of
        a call already counted, made again), records the rows it hands out for the gradients
        that will come back.
        """
        pull = (request.trainer, request.call) if train or again else None
        reading = Reading(train=train, clock=clock, pull=pull)
        start = time.perf_counter()
        reply = PushPullReply()
        if request.pull_dense:
            dense = self.store.read_dense(state=request.pull_dense_state)
            reply.dense.update(dense.values)
            reply.dense_versions.update(dense.versions)
            for name, state in dense.state.items():
                _add_state(reply.dense_state, name, state)
        pulls = request.pull_rows
        asks = ReadAsks(
            request.pull_versions.keys(), request.pull_state, (request.trainer, request.call - 1)
        )
        read = self.store.read(pulls, reading, asks)
        reply.rows.update(read.values)
        for name, versions in read.versions.items():
            self._leave_out_cached(reply, request, name, read.values[name], versions)
        reply.row_state = self._state_blocks(read.state)
        rows = sum([ids.numel() for ids in pulls.values()])
        for name, block in request.pool_rows.items():
            reply.pooled[name] = self._pool(name, block, reading)
            rows += block.ids.numel()
        self._encode(reply)
        with self.stats.lock:
            self.stats.rows_pulled += rows
            self.stats.read_seconds += time.perf_counter() - start
        return reply

    def _leave_out_cached(
        self,
        reply: PushPullReply,
        request: DecodedRequest,
        name: str,
        values: Tensor,
        versions: Tensor,
    ) -> None:
        """Answer with only those of the rows read for ``name`` (``values`` with their
        ``versions``: the trainer caches them) that its cached copies are too old for."""
        assert self.cache_lag is not None  # validated
        cached = request.pull_versions[name]
        sending = must_send(cached, versions, self.cache_lag)
        reply.rows[name] = values[sending]
        reply.row_versions[name] = torch.where(sending, versions, cached)

    def _encode(self, reply: PushPullReply) -> None:
        if self.dense_pull_codec != "none":
            for name, value in reply.dense.items():
                reply.dense[name] = encode(self.dense_pull_codec, value)  # type: ignore[arg-type]
        for part in (reply.rows, reply.pooled):
            for name, value in part.items():
                codec = self.table_pull_codecs[name]
                if codec != "none":
                    part[name] = encode(codec, value)  # type: ignore[arg-type]
        self._encode_state(reply)

    def _state_codec(self, table: str) -> str:
        """The codec ``table``'s rows' state travels by: its values' where the rule's own
        update takes it lossy (:attr:`~paramserver.optim.UpdateRule.lossy_state_ok`): a
        prefetching trainer's own update only predicts this server's, which the server makes
        itself from its own state."""
        lossy = self.store.tables[table].rule.lossy_state_ok
        return self.table_pull_codecs[table] if lossy else "none"

    def _state_blocks(self, reads: list[StateRead]) -> list[RowStateBlock]:
        """The state the store read (each arena's tables together), those of alike parts
        (names, widths, dtypes) and codec joined in one block each, in order."""
        alike: dict[
            tuple[tuple[tuple[str, torch.Size, torch.dtype], ...], str], list[StateRead]
        ] = {}
        for codec, read in _by_codec(reads, self._state_codec):
            of_read = read.parts
            kinds = tuple((p, v.shape[1:], v.dtype) for p, v in of_read.items() if p != ROW_HELD)
            alike.setdefault((kinds, codec), []).append(read)
        blocks = []
        for (kinds, codec), group in alike.items():
            parts: dict[str, Tensor | Encoded] = {}
            for part, *_ in kinds:
                values = [read.parts[part] for read in group]
                joined = values[0] if len(values) == 1 else torch.cat(values)
                exact = codec == "none" or part == ROW_STEPS
                parts[part] = joined if exact else encode(codec, joined)
            held = None
            if any(ROW_HELD in read.parts for read in group):
                held = torch.cat(
                    [
                        read.parts.get(ROW_HELD, torch.ones(sum(read.counts), dtype=torch.bool))
                        for read in group
                    ]
                )
            names = tuple(name for read in group for name in read.names)
            counts = tuple(count for read in group for count in read.counts)
            blocks.append(RowStateBlock(names, counts, parts, held))
        return blocks

    def _encode_state(self, reply: PushPullReply) -> None:
        """The dense values' optimizer state travels by their codec where the rule's own
        update takes it lossy (see :meth:`_state_codec`); counts go exact."""
        codec = self.dense_pull_codec
        if codec == "none":
            return
        for key, value in reply.dense_state.items():
            name, slot = split_state_key(key)
            if slot != ROW_STEPS and self.store.dense[name].rule.lossy_state_ok:
                reply.dense_state[key] = encode(codec, value)  # type: ignore[arg-type]

    def _pool(self, name: str, block: BagBlock, reading: Reading) -> Tensor:
        """Partial sums ``[num_bags, dim]`` of this server's rows in each bag."""
        unique, inverse = block.distinct
        rows = self.store.read({name: unique}, reading).values[name]
        members = rows[inverse]
        if block.weights is not None:
            members = members * block.weights.unsqueeze(1)
        pooled = torch.zeros(block.num_bags, rows.shape[1], dtype=rows.dtype)
        return pooled.index_add_(0, block.bags, members)

    # ---- whole-shard views ----

    def dense_check(self, checksums: dict) -> dict[str, ServerView]:
        """Each named dense parameter's version and checksum, and its value where the
        trainer's ``checksums`` (name -> checksum of its replica) differ."""
        for name, theirs in checksums.items():
            if type(name) is not str or type(theirs) is not str:
                raise ParamServerError(
                    f"server {self.server}: dense_check takes parameter names and checksum "
                    f"strings, got {name!r}: {type(theirs).__name__}"
                )
        unknown = set(checksums) - set(self.store.dense)
        if unknown:
            raise ParamServerError(
                f"server {self.server}: holds no dense parameter {sorted(unknown)[0]!r}"
            )
        views = {}
        read = self.store.read_dense(checksums)
        for name, theirs in checksums.items():
            value, version = read.values[name], read.versions[name]
            ours = checksum(value)
            views[name] = ServerView(version, ours, None if ours == theirs else value)
        return views


def _by_codec(
    reads: list[StateRead], codec_of: Callable[[str], str]
) -> list[tuple[str, StateRead]]:
    """``reads`` with the codec their state travels by, each split where its tables' codecs
    differ."""
    split = []
    for read in reads:
        codecs = [codec_of(name) for name in read.names]
        if len(set(codecs)) == 1:
            split.append((codecs[0], read))
            continue
        starts = itertools.accumulate(read.counts, initial=0)
        for name, codec, start, count in zip(read.names, codecs, starts, read.counts, strict=False):
            parts = {part: value[start : start + count] for part, value in read.parts.items()}
            split.append((codec, StateRead([name], [count], parts)))
    return split


def _add_state(into: dict[str, Tensor | Encoded], name: str, state: Mapping[str, Tensor]) -> None:
    into.update((state_key(name, part), value) for part, value in state.items())
