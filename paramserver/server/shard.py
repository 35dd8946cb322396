"""A server's shard: the dense parameters placed on it and its rows of every table.

Each dense parameter and each table shard carries its own update rule, state slots and lock;
optimizer state lives beside the rows it belongs to (row ``i`` of a slot is the state of local
row ``i``), so a checkpoint or export of rows carries their state with them.

Thread-safety: every method may be called from many RPC threads at once. Each parameter and
table has a lock held while its values or state are read or written. An update holds the locks
of everything it updates together (one optimizer call serves all the tables of a rule), taken
in one global order (``_holding``), so two updates cannot deadlock; no other method holds two
locks at once, and none blocks waiting for another call (waiting is done by the consistency
policy's Futures).
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from paramserver.compression import CODECS, ROW_CODECS, Encoded, decode, encode, validate
from paramserver.config import ShardSettings
from paramserver.errors import InvalidPushError, ParamServerError
from paramserver.idcodec import PackedIds, num_ids, packed_problem, unpack_ids
from paramserver.idmap import FusedIdMap, TableIds
from paramserver.observe import peak_rss_bytes
from paramserver.observe.consistency import checksum
from paramserver.protocol import (
    BagBlock,
    PushPullReply,
    PushPullRequest,
    RowBlock,
    ServerView,
    message_nbytes,
    message_sizes,
    must_send,
)
from paramserver.server.dynamic import DynamicTable, locate_together
from paramserver.server.optim import Block, RowUpdate, State, UpdateRule, apply_updates, make_rule
from paramserver.server.tables import FixedTable, Pull, Reading, TableShard
from paramserver.sharding import ShardPlan, TableSpec
from paramserver.tableinit import RowInit


@dataclass
class DenseSlot:
    value: Tensor
    rule: UpdateRule
    state: State
    # Updates applied: the value's version, and the step count its update rule reads.
    version: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float32))
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class ServerStats:
    pushes: int = 0
    rows_updated: int = 0
    rows_pulled: int = 0
    update_seconds: float = 0.0
    read_seconds: float = 0.0
    bytes_received: int = 0
    bytes_sent: int = 0
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


def already_decoded(value: Tensor | Encoded) -> Tensor:
    """A gradient of a request past :meth:`ServerShard.decode_request`, which decoded every
    encoded one, once, after checking it: the tensor itself. Nothing after that step decodes
    (an encoded value here is a bug: raises TypeError)."""
    if not isinstance(value, Tensor):
        raise TypeError(f"an encoded gradient past decoding: {type(value).__name__}")
    return value


def already_unpacked(ids: Tensor | PackedIds) -> Tensor:
    """Row ids of a request past :meth:`ServerShard.decode_request`, which unpacked every
    packed one after checking it: the tensor itself (packed ids here are a bug: TypeError)."""
    if not isinstance(ids, Tensor):
        raise TypeError(f"packed ids past decoding: {type(ids).__name__}")
    return ids


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
    """Holds server ``server``'s parameters; validates, applies and answers pushes and pulls."""

    def __init__(
        self,
        server: int,
        plan: ShardPlan,
        dense: Mapping[str, Tensor],
        table_inits: Mapping[str, RowInit],
        settings: ShardSettings,
    ):
        """``dense`` holds the starting values of the dense parameters (those placed here are
        copied), ``table_inits`` how each fixed table's rows start (this server makes its own
        rows only); dynamic tables start empty."""
        self.server = server
        self.plan = plan
        self.stats = ServerStats()
        self.dense: dict[str, DenseSlot] = {}
        for name in plan.dense_on(server):
            value = dense[name].detach().clone().contiguous()
            rule = make_rule(settings.dense_rule)
            self.dense[name] = DenseSlot(value, rule, rule.init_state(value))
        self.cache_lag = settings.cache_lag
        # The dynamic tables share one id map, so that a request's ids of all of them cost one
        # search and one insert (see read), and so one lock.
        dynamic = [name for name, spec in plan.tables.items() if spec.dynamic is not None]
        self.dynamic_ids = FusedIdMap(len(dynamic))
        self.dynamic_lock = threading.Lock()
        shared = {n: (self.dynamic_ids.table(i), self.dynamic_lock) for i, n in enumerate(dynamic)}
        self.tables: dict[str, TableShard] = {
            name: make_table(
                spec,
                plan,
                server,
                table_inits.get(name),
                make_rule(settings.table_rules[name]),
                self.cache_lag,
                shared.get(name),
            )
            for name, spec in plan.tables.items()
        }
        self.dynamic_tables = {n: t for n, t in self.tables.items() if isinstance(t, DynamicTable)}
        self.dense_pull_codec = settings.dense_pull_codec
        self.table_pull_codecs = dict(settings.table_pull_codecs)
        self.clock = 0  # the highest call number seen: dynamic tables' time
        self._clock_lock = threading.Lock()

    # ---- validation: a push is checked whole before anything is applied ----

    def check_size(self, request: PushPullRequest, max_bytes: int) -> int:
        """Refuse a call that would make this server hold over ``max_bytes`` for it, before
        anything in it is decoded or read; returns its bytes on the wire (measured in the same
        walk: :func:`~paramserver.protocol.message_sizes`).

        Two measures, each against ``max_bytes``: the request with its tensors decoded, and
        the rows its answer reads (``n`` ids of a ``dim``-wide table read ``n x dim`` values
        however few are sent; a pooled pull also reads a row per id, then ``num_bags x dim``
        sums). Dense values are not counted: their size is the model's, not the caller's. Only
        the request's header (field types) must have been checked; malformed contents count 0
        here and are refused by :meth:`validate`.
        """
        held, sent = message_sizes(request)
        if held > max_bytes:
            raise self._reject(
                _largest(self._request_nbytes(request)),
                f"a call holding {held} bytes once decoded exceeds the cap of {max_bytes} "
                "bytes (--max-message-mb)",
            )
        answer = self._answer_nbytes(request)
        read = sum(answer.values())
        if read > max_bytes:
            raise self._reject(
                _largest(answer),
                f"an answer reading {read} bytes of rows exceeds the cap of {max_bytes} bytes "
                "(--max-message-mb)",
            )
        return sent

    @staticmethod
    def _request_nbytes(request: PushPullRequest) -> dict[str, int]:
        """:func:`message_nbytes` of each parameter's parts of ``request``."""
        sizes: dict[str, int] = {}
        for part in (
            request.dense_grads,
            request.row_grads,
            request.pull_rows,
            request.pull_versions,
            request.pool_rows,
            request.pooled_grads,
        ):
            for name, value in part.items():
                sizes[name] = sizes.get(name, 0) + message_nbytes(value)
        return sizes

    def _answer_nbytes(self, request: PushPullRequest) -> dict[str, int]:
        """Bytes of rows each table's part of the answer reads (see :meth:`check_size`)."""
        sizes: dict[str, int] = {}
        for name, ids in request.pull_rows.items():
            table = self.tables.get(name)
            if table is not None:
                version_bytes = 8 if name in request.pull_versions else 0
                per_id = table.spec.dim * table.weight.element_size() + version_bytes
                sizes[name] = num_ids(ids) * per_id
        for name, block in request.pool_rows.items():
            table = self.tables.get(name)
            if (
                table is not None
                and type(block) is BagBlock
                and isinstance(block.ids, Tensor)
                and type(block.num_bags) is int
            ):
                rows = block.ids.numel() + max(block.num_bags, 0)
                row_bytes = table.spec.dim * table.weight.element_size()
                sizes[name] = sizes.get(name, 0) + rows * row_bytes
        return sizes

    def decode_request(self, request: PushPullRequest) -> None:
        """Replace packed row ids by int64 ids and encoded gradients by their float32 values
        (before :meth:`validate`), the one place a request's ids and gradients are decoded
        (pooled ones: as they are expanded); raise :class:`InvalidPushError` for packed ids
        that are malformed (checked before they are unpacked, and first of all), for an
        encoding that does not stand for the expected shape, in a codec trainers use there,
        or for row ids that are invalid (checked before a row gradient is decoded: they set
        the size it decodes to). A request without gradients has its ids unpacked alone."""
        self._unpack_ids(request)
        for name, grad in request.dense_grads.items():
            slot = self.dense.get(name)
            if type(grad) is Encoded and slot is not None:
                request.dense_grads[name] = self.decoded(name, grad, tuple(slot.value.shape))
        for name, block in request.row_grads.items():
            table = self.tables.get(name)
            if type(block) is RowBlock and type(block.values) is Encoded and table is not None:
                self._check_ids(name, table, block.ids, sorted_unique=True)
                shape = (num_ids(block.ids), table.spec.dim)
                block.values = self.decoded(name, block.values, shape)

    def _unpack_ids(self, request: PushPullRequest) -> None:
        """Unpack the packed ids of row gradients and pulls, each checked first; others stay
        as they are (plain ids, or anything else, which :meth:`validate` refuses)."""
        for name, block in request.row_grads.items():
            if type(block) is RowBlock:
                block.ids = self._unpacked(name, block.ids)
        for name, ids in request.pull_rows.items():
            request.pull_rows[name] = self._unpacked(name, ids)

    def _unpacked(self, name: str, ids: Tensor | PackedIds) -> Tensor | PackedIds:
        if type(ids) is not PackedIds:
            return ids
        problem = packed_problem(ids)
        if problem is not None:
            raise self._reject(name, f"malformed packed ids: {problem}")
        return unpack_ids(ids)

    def decoded(self, name: str, encoded: Encoded, shape: tuple[int, ...]) -> Tensor:
        """``encoded`` decoded, once checked to stand for ``shape`` in a codec trainers use
        for ``name``: any for a dense gradient, no top-k for rows or pooled vectors."""
        codecs = CODECS if name in self.dense else ROW_CODECS
        problem = validate(encoded, shape, codecs)
        if problem is not None:
            raise self._reject(name, f"malformed encoding: {problem}")
        return decode(encoded)

    def _reject(self, param: str | None, reason: str) -> InvalidPushError:
        return InvalidPushError(reason, param=param, server=self.server)

    def validate(self, request: PushPullRequest) -> None:
        """Raise :class:`InvalidPushError` if any part of ``request`` is malformed.

        The request's header (field types) was checked by the coordinator; this checks contents:
        the gradients, then the reads.
        """
        self._check_grads(request)
        self._check_reads(request)

    def _table(self, name: str) -> TableShard:
        """The table ``name``, or the refusal of a request naming one this server lacks."""
        table = self.tables.get(name)
        if table is None:
            raise self._reject(name, self._not_here(name))
        return table

    def _check_grads(self, request: PushPullRequest) -> None:
        for name, grad in request.dense_grads.items():
            slot = self.dense.get(name)
            if slot is None:
                raise self._reject(name, self._not_here(name))
            self.check_tensor(name, grad, slot.value.shape, slot.value.dtype)
        for name, block in request.row_grads.items():
            table = self._table(name)
            if type(block) is not RowBlock:
                raise self._reject(name, "malformed row gradients: expected a RowBlock")
            self._check_ids(name, table, block.ids, sorted_unique=True)
            self.check_tensor(
                name, block.values, (num_ids(block.ids), table.spec.dim), table.weight.dtype
            )

    def _check_reads(self, request: PushPullRequest) -> None:
        for name, ids in request.pull_rows.items():
            self._check_ids(name, self._table(name), ids, sorted_unique=True)
        for name, cached in request.pull_versions.items():
            pulled = request.pull_rows.get(name)
            if pulled is None or self.cache_lag is None:
                raise self._reject(name, "cached versions without a pull, or caching is off")
            if (
                not isinstance(cached, Tensor)
                or cached.dtype != torch.int64
                or tuple(cached.shape) != (num_ids(pulled),)
                or cached.layout != torch.strided
                or cached.device.type != "cpu"
                or (cached.numel() and int(cached.min()) < -1)
            ):
                raise self._reject(name, "cached versions must be int64 >= -1, one per id")
        for name, bags in request.pool_rows.items():
            self._check_bags(name, self._table(name), bags)

    def _check_bags(self, name: str, table: TableShard, block: object) -> None:
        if type(block) is not BagBlock or type(block.num_bags) is not int:
            raise self._reject(name, "malformed bags: expected a BagBlock")
        if block.num_bags < 0:  # its size is capped with the answer's (check_size)
            raise self._reject(name, f"negative num_bags {block.num_bags}")
        self._check_ids(name, table, block.ids, sorted_unique=False)
        count = block.ids.numel()
        bags = block.bags
        if (
            not isinstance(bags, Tensor)
            or bags.dtype != torch.int64
            or tuple(bags.shape) != (count,)
            or bags.layout != torch.strided
            or bags.device.type != "cpu"
        ):
            raise self._reject(name, "bag indices must be int64, one per id")
        if count and (int(bags.min()) < 0 or int(bags.max()) >= block.num_bags):
            raise self._reject(name, f"bag index outside [0, {block.num_bags})")
        if block.weights is not None:
            self.check_tensor(name, block.weights, (count,), table.weight.dtype)

    def _not_here(self, name: str) -> str:
        if name in self.plan.dense_server:
            return f"unknown here: dense parameter lives on server {self.plan.dense_server[name]}"
        if name in self.plan.dense:
            return "unknown here: the trainers keep dense parameters (--dense-sync allreduce)"
        return "unknown parameter or table name"

    def check_tensor(
        self, name: str, value: object, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype
    ) -> None:
        if not isinstance(value, Tensor):
            raise self._reject(name, f"expected a tensor, got {type(value).__name__}")
        if value.layout != torch.strided or value.device.type != "cpu" or value.requires_grad:
            raise self._reject(name, "expected a plain dense CPU tensor without autograd")
        if value.dtype != dtype:
            raise self._reject(name, f"gradient dtype {value.dtype} != parameter dtype {dtype}")
        if tuple(value.shape) != tuple(shape):
            raise self._reject(
                name, f"gradient shape {tuple(value.shape)} != expected {tuple(shape)}"
            )
        # A finite sum proves every element finite (NaN and Inf propagate); only an overflowing
        # sum needs the element-wise check.
        if not math.isfinite(float(value.sum())) and not bool(torch.isfinite(value).all()):
            raise self._reject(name, "gradient contains NaN or Inf")

    def _check_ids(self, name: str, table: TableShard, ids: object, *, sorted_unique: bool) -> None:
        if (
            not isinstance(ids, Tensor)
            or ids.dtype != torch.int64
            or ids.dim() != 1
            or ids.layout != torch.strided
            or ids.device.type != "cpu"
        ):
            raise self._reject(name, "row ids must be a 1-D int64 CPU tensor")
        if ids.numel() == 0:
            return
        values = ids.numpy()  # numpy: a few hundred ids cost less there than in torch
        ordered = values.size < 2 or bool((values[1:] > values[:-1]).all())
        # The ends of sorted ids are their extremes.
        ends = (values[0], values[-1]) if ordered else (values.min(), values.max())
        problem = table.check_range(int(ends[0]), int(ends[1]))
        if problem is not None:
            raise self._reject(name, problem)
        if self.plan.num_servers > 1 and bool(
            (self.plan.server_of_rows(name, ids) != self.server).any()
        ):
            raise self._reject(name, "row ids routed to the wrong server")
        if sorted_unique and not ordered:
            raise self._reject(name, "row ids must be sorted and unique")

    # ---- applying and reading ----

    def advance_clock(self, call: int) -> int:
        with self._clock_lock:
            self.clock = max(self.clock, call)
            return self.clock

    @torch.no_grad()
    def apply(
        self,
        dense_grads: Mapping[str, Tensor | Encoded],
        row_grads: Mapping[str, RowBlock],
        clock: int = 0,
        pull: Pull | None = None,
        step: int = 0,
    ) -> None:
        """Apply gradients decoded (:meth:`decode_request`) and validated (:meth:`validate`).
        Each parameter is updated under its own lock.

        ``pull``: the (trainer, call) whose answer the gradients were computed from (None for
        a sync round's sum, checked by :meth:`drop_grads_of_replaced_rows` first), so dynamic
        tables apply them only to the rows that call read. ``step``: the gradients' training
        step, whose learning rate each group's schedule gives (a schedule that gives none
        raises ConfigError before anything is changed).
        """
        start = time.perf_counter()
        dense_lr, table_lrs = self.learning_rates(step, dense_grads, row_grads)
        if dense_grads:
            self._apply_dense(dense_grads, dense_lr)
        rows = self._apply_rows(row_grads, table_lrs, clock, pull) if row_grads else 0
        with self.stats.lock:
            self.stats.pushes += 1
            self.stats.rows_updated += rows
            self.stats.update_seconds += time.perf_counter() - start

    def _apply_dense(self, dense_grads: Mapping[str, Tensor | Encoded], lr: float) -> None:
        """One step of the dense rule over every dense gradient (one torch.optim call where
        the rule allows it), their locks held together."""
        slots = {name: self.dense[name] for name in dense_grads}
        blocks = [
            Block(slot.value, already_decoded(dense_grads[name]), slot.state, slot.version)
            for name, slot in slots.items()
        ]
        with _holding(slot.lock for slot in slots.values()):
            next(iter(slots.values())).rule.step_blocks(blocks, lr)

    def _apply_rows(
        self, row_grads: Mapping[str, RowBlock], lrs: Mapping[str, float], clock: int,
        pull: Pull | None,
    ) -> int:  # fmt: skip
        """Each table's :meth:`TableShard.apply`, the tables of one rule and lr stepped
        together (:func:`apply_updates`), their locks held together; returns rows updated."""
        tables = {name: self.tables[name] for name in row_grads}
        with _holding(table.lock for table in tables.values()):
            updates: dict[str, RowUpdate] = {}
            together: dict[tuple[object, ...], list[str]] = {}
            for name, block in row_grads.items():
                ids, grads = already_unpacked(block.ids), already_decoded(block.values)
                table = tables[name]
                updates[name] = table.row_update(ids, grads, pull)
                key = (type(table.rule), table.rule.config, lrs[name])
                together.setdefault(key, []).append(name)
            for names in together.values():
                rule = tables[names[0]].rule  # the same rule as the others'
                apply_updates(rule, [updates[name] for name in names], lrs[names[0]])
            return sum(tables[name].updated(updates[name], clock) for name in updates)

    def learning_rates(
        self, step: int, dense_grads: Mapping[str, object], row_grads: Mapping[str, object]
    ) -> tuple[float, dict[str, float]]:
        """The lr of training step ``step`` for the dense parameters (group ``"dense"``: one
        rule for all) and for each table of ``row_grads``; raises ConfigError naming the group
        and the step where a schedule gives no valid factor."""
        dense_lr = 0.0
        if dense_grads:
            dense_lr = self.dense[next(iter(dense_grads))].rule.lr_at(step, "dense")
        table_lrs = {name: self.tables[name].rule.lr_at(step, name) for name in row_grads}
        return dense_lr, table_lrs

    def drop_grads_of_replaced_rows(self, request: PushPullRequest) -> None:
        """Drop the row gradients of ``request`` whose rows dynamic tables removed since its
        call ``grads_call`` read them (before a sync round sums several trainers' gradients)."""
        pull = (request.trainer, request.grads_call)
        for name, block in request.row_grads.items():
            table = self.tables[name]
            ids = already_unpacked(block.ids)
            with table.lock:
                kept = table.rows_still_pulled(ids, pull)
            if kept is not None and not bool(kept.all()):
                values = already_decoded(block.values)
                request.row_grads[name] = RowBlock(ids[kept], values[kept])

    def read(
        self, request: PushPullRequest, *, train: bool, clock: int = 0, again: bool = False
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
            for name, slot in self.dense.items():
                with slot.lock:
                    reply.dense[name] = slot.value.clone()
                    reply.dense_versions[name] = int(slot.version)
        rows = 0
        pulls = {name: already_unpacked(ids) for name, ids in request.pull_rows.items()}
        dynamic = {n: ids for n, ids in pulls.items() if n in self.dynamic_tables}
        if dynamic:
            with self.dynamic_lock:
                located = locate_together(self.dynamic_tables, dynamic, self.dynamic_ids, reading)
                for name, found in located.items():
                    hashed = self.dynamic_tables[name]
                    versions = hashed.versions_of(found) if name in request.pull_versions else None
                    self._answer(reply, request, name, hashed.values(found), versions)
        for name, ids in pulls.items():
            rows += ids.numel()
            if name in dynamic:
                continue
            table = self.tables[name]
            with table.lock:
                if name in request.pull_versions:
                    values, versions = table.read_versioned(ids, reading)
                    self._answer(reply, request, name, values, versions)
                else:
                    self._answer(reply, request, name, table.read(ids, reading), None)
        for name, block in request.pool_rows.items():
            reply.pooled[name] = self._pool(name, block, reading)
            rows += block.ids.numel()
        self._encode(reply)
        with self.stats.lock:
            self.stats.rows_pulled += rows
            self.stats.read_seconds += time.perf_counter() - start
        return reply

    def _answer(
        self,
        reply: PushPullReply,
        request: PushPullRequest,
        name: str,
        values: Tensor,
        versions: Tensor | None,
    ) -> None:
        """Put the rows read for ``name`` in ``reply``: with versions (the trainer caches), only
        those its cached copies are too old for."""
        if versions is None:
            reply.rows[name] = values
            return
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

    def _pool(self, name: str, block: BagBlock, reading: Reading) -> Tensor:
        """Partial sums ``[num_bags, dim]`` of this server's rows in each bag."""
        table = self.tables[name]
        unique, inverse = block.distinct
        with table.lock:
            rows = table.read(unique, reading)
        members = rows[inverse]
        if block.weights is not None:
            members = members * block.weights.unsqueeze(1)
        pooled = torch.zeros(block.num_bags, table.spec.dim, dtype=rows.dtype)
        return pooled.index_add_(0, block.bags, members)

    # ---- whole-shard views, for export, tests and checkpoints ----

    def export_state(self, with_optimizer: bool = False) -> dict[str, dict[str, Tensor]]:
        """Copies of this shard's values (and optionally optimizer state and step counts);
        table rows keyed by global row id or id (``"ids"``), as
        :meth:`TableShard.snapshot` has them."""
        out: dict[str, dict[str, Tensor]] = {}
        for name, slot in self.dense.items():
            with slot.lock:
                entry = {"value": slot.value.clone()}
                if with_optimizer:
                    entry.update({f"state.{k}": v.clone() for k, v in slot.state.items()})
                    entry["steps"] = slot.version.clone()
            out[name] = entry
        kept = ("ids", "value", "steps") if with_optimizer else ("ids", "value")
        for name, table in self.tables.items():
            with table.lock:
                rows, _ = table.snapshot()
            out[name] = {
                k: v
                for k, v in rows.items()
                if k in kept or (with_optimizer and k.startswith("state."))
            }
        return out

    def dense_check(self, checksums: dict) -> dict[str, ServerView]:
        """Each named dense parameter's version and checksum, and its value where the
        trainer's ``checksums`` (name -> checksum of its replica) differ."""
        for name, theirs in checksums.items():
            if type(name) is not str or type(theirs) is not str:
                raise ParamServerError(
                    f"server {self.server}: dense_check takes parameter names and checksum "
                    f"strings, got {name!r}: {type(theirs).__name__}"
                )
        unknown = set(checksums) - set(self.dense)
        if unknown:
            raise ParamServerError(
                f"server {self.server}: holds no dense parameter {sorted(unknown)[0]!r}"
            )
        views = {}
        for name, theirs in checksums.items():
            slot = self.dense[name]
            with slot.lock:
                value, version = slot.value.clone(), int(slot.version)
            ours = checksum(value)
            views[name] = ServerView(version, ours, None if ours == theirs else value)
        return views

    def table_stats(self) -> dict[str, dict[str, int]]:
        result = {}
        for name, table in self.tables.items():
            with table.lock:
                result[name] = table.stats()
        return result

    def state_hash(self) -> str:
        """A digest of every value, state slot and step count on this shard."""
        digest = hashlib.sha256()
        for name, entry in sorted(self.export_state(with_optimizer=True).items()):
            for key, tensor in sorted(entry.items()):
                digest.update(f"{name}/{key}".encode())
                digest.update(tensor.contiguous().numpy().tobytes())
        return digest.hexdigest()


@contextmanager
def _holding(locks: Iterable[threading.Lock]) -> Iterator[None]:
    """Hold each of ``locks`` (a lock shared by several only once), taken in the order of
    their ids, so two callers holding some of the same ones cannot deadlock."""
    unique = {id(lock): lock for lock in locks}
    with ExitStack() as stack:
        for key in sorted(unique):
            stack.enter_context(unique[key])
        yield


def _largest(sizes: dict[str, int]) -> str | None:
    """The name with the most bytes, to name in an error (None if there is none)."""
    return max(sizes, key=lambda name: sizes[name]) if sizes else None


def make_table(
    spec: TableSpec,
    plan: ShardPlan,
    server: int,
    init: RowInit | None,
    rule: UpdateRule,
    cache_lag: int | None = None,
    shared: tuple[TableIds, threading.Lock] | None = None,
) -> TableShard:
    """This server's shard of the table ``spec``: dynamic (``shared``: its view of the id map
    the server's dynamic tables share, and their lock), or fixed with rows from ``init``."""
    if spec.dynamic is not None:
        return DynamicTable(spec, rule, cache_lag, shared)
    assert init is not None
    return FixedTable(spec, plan, server, init, rule, cache_lag)
