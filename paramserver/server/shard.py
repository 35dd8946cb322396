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
import itertools
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor

from paramserver.compression import Encoded, encode
from paramserver.config import ShardSettings
from paramserver.errors import ParamServerError
from paramserver.idcodec import PackedIds
from paramserver.idmap import FusedIdMap
from paramserver.observe import peak_rss_bytes
from paramserver.observe.consistency import checksum
from paramserver.optim import (
    Block,
    RowUpdate,
    State,
    UpdateRule,
    apply_updates,
    make_rule,
    take_rows,
)
from paramserver.protocol import (
    ROW_STEPS,
    BagBlock,
    PushPullReply,
    PushPullRequest,
    RowBlock,
    ServerView,
    must_send,
    state_key,
)
from paramserver.server.dynamic import DynamicTable, SharedRows
from paramserver.server.dynamic_rows import dynamic_arena, locate_together, values_together
from paramserver.server.requests import RequestChecks
from paramserver.server.tables import (
    FixedTable,
    Pull,
    Reading,
    RowArena,
    TableShard,
    by_arena,
)
from paramserver.sharding import ShardPlan
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
    """A gradient of a request past :meth:`RequestChecks.decode_request`, which decoded every
    encoded one, once, after checking it: the tensor itself. Nothing after that step decodes
    (an encoded value here is a bug: raises TypeError)."""
    if not isinstance(value, Tensor):
        raise TypeError(f"an encoded gradient past decoding: {type(value).__name__}")
    return value


def already_unpacked(ids: Tensor | PackedIds) -> Tensor:
    """Row ids of a request past :meth:`RequestChecks.decode_request`, which unpacked every
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
        rules = {name: make_rule(settings.table_rules[name]) for name in plan.tables}
        self.tables, self.dynamic_ids, self.dynamic_lock = make_tables(
            plan, server, table_inits, rules, self.cache_lag
        )
        self.dynamic_tables = {n: t for n, t in self.tables.items() if isinstance(t, DynamicTable)}
        self.dense_pull_codec = settings.dense_pull_codec
        self.table_pull_codecs = dict(settings.table_pull_codecs)
        self.clock = 0  # the highest call number seen: dynamic tables' time
        self._clock_lock = threading.Lock()
        self.checks = RequestChecks(server, plan, self.dense, self.tables, self.cache_lag)

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
        """Apply gradients decoded and validated (:attr:`checks`).
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
            self._read_dense(request, reply)
        pulls = {name: already_unpacked(ids) for name, ids in request.pull_rows.items()}
        dynamic = {n: ids for n, ids in pulls.items() if n in self.dynamic_tables}
        if dynamic:
            self._read_dynamic(request, dynamic, reading, reply)
        fixed = {n: ids for n, ids in pulls.items() if n not in dynamic}
        versioned = {n: ids for n, ids in fixed.items() if n in request.pull_versions}
        self._read_versioned(request, versioned, reading, reply)
        plain = {n: ids for n, ids in fixed.items() if n not in versioned}
        self._read_fixed(plain, request.pull_state, reply)
        rows = sum(ids.numel() for ids in pulls.values())
        for name, block in request.pool_rows.items():
            reply.pooled[name] = self._pool(name, block, reading)
            rows += block.ids.numel()
        self._encode(reply)
        with self.stats.lock:
            self.stats.rows_pulled += rows
            self.stats.read_seconds += time.perf_counter() - start
        return reply

    def _read_dense(self, request: PushPullRequest, reply: PushPullReply) -> None:
        """Every dense value here, with its version (and, asked, its state and count)."""
        for name, slot in self.dense.items():
            with slot.lock:
                reply.dense[name] = slot.value.clone()
                reply.dense_versions[name] = int(slot.version)
                if request.pull_dense_state:
                    state = {part: v.clone() for part, v in slot.state.items()}
                    state[ROW_STEPS] = slot.version.clone()
                    _add_state(reply.dense_state, name, state)

    def _read_dynamic(
        self,
        request: PushPullRequest,
        pulls: Mapping[str, Tensor],
        reading: Reading,
        reply: PushPullReply,
    ) -> None:
        """Dynamic tables' rows of ``pulls``, all found (and made) together; the state of
        those the request's masks pick, with which of them take the trainer's pending update
        (computed from its call before this one)."""
        with self.dynamic_lock:
            located = locate_together(self.dynamic_tables, pulls, self.dynamic_ids, reading)
            read = values_together(self.dynamic_tables, located)
            for name, found in located.items():
                table = self.dynamic_tables[name]
                versions = table.versions_of(found) if name in request.pull_versions else None
                self._answer(reply, request, name, read[name], versions)
                mask = request.pull_state.get(name)
                if mask is not None:
                    asked, at = pulls[name][mask], found[mask]
                    previous = (request.trainer, request.call - 1)
                    held = table.rows_taking_update(asked, at, previous)
                    _add_state(reply.row_state, name, table.arena.state_of(at, held))

    def _read_versioned(
        self,
        request: PushPullRequest,
        pulls: Mapping[str, Tensor],
        reading: Reading,
        reply: PushPullReply,
    ) -> None:
        """Fixed tables' rows of ``pulls`` that the trainer caches: only those its copies are
        too old for, with every row's version (and the state of those the masks pick)."""
        for name, ids in pulls.items():
            table = cast("FixedTable", self.tables[name])
            with table.lock:
                values, versions = table.read_versioned(ids, reading)
                if name in request.pull_state:
                    asked = ids[request.pull_state[name]]
                    state = table.arena.state_of(table.arena_rows(asked))
                    _add_state(reply.row_state, name, state)
            self._answer(reply, request, name, values, versions)

    def _read_fixed(
        self, pulls: Mapping[str, Tensor], state_masks: Mapping[str, Tensor], reply: PushPullReply
    ) -> None:
        """Answer the rows of fixed tables' ids ``pulls`` (valid), those of tables sharing an
        arena taken in one call under their locks (the tensors are then views of one), and
        with them the state of the rows ``state_masks`` pick."""
        for names in by_arena(self.tables, pulls):
            tables = cast("list[FixedTable]", [self.tables[name] for name in names])
            arena_rows = [t.arena_rows(pulls[n]) for t, n in zip(tables, names, strict=True)]
            rows = torch.cat(arena_rows)
            with _holding(table.lock for table in tables):
                together = take_rows(tables[0].arena.weight, rows.numpy())
                for name, table_rows in zip(names, arena_rows, strict=True):
                    if name in state_masks:
                        state = tables[0].arena.state_of(table_rows[state_masks[name]])
                        _add_state(reply.row_state, name, state)
            counts = [pulls[name].numel() for name in names]
            reply.rows.update(zip(names, together.split_with_sizes(counts), strict=True))

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


def _add_state(into: dict[str, Tensor], name: str, state: Mapping[str, Tensor]) -> None:
    into.update((state_key(name, part), value) for part, value in state.items())


@contextmanager
def _holding(locks: Iterable[threading.Lock]) -> Iterator[None]:
    """Hold each of ``locks`` (a lock shared by several only once), taken in the order of
    their ids, so two callers holding some of the same ones cannot deadlock."""
    unique = {id(lock): lock for lock in locks}
    ordered = [unique[key] for key in sorted(unique)]
    held = 0
    try:  # a plain loop, not an ExitStack: a call takes these several times
        for lock in ordered:
            lock.acquire()
            held += 1
        yield
    finally:
        for lock in reversed(ordered[:held]):
            lock.release()


def make_tables(
    plan: ShardPlan,
    server: int,
    inits: Mapping[str, RowInit],
    rules: Mapping[str, UpdateRule],
    cache_lag: int | None = None,
) -> tuple[dict[str, TableShard], FusedIdMap, threading.Lock]:
    """This server's shards of the tables of ``plan``, each with its update rule from
    ``rules``, and the id map and lock its dynamic tables share.

    Tables of one kind (fixed or dynamic, width, dtype, update rule) keep their rows in one
    :class:`~paramserver.server.tables.RowArena`, so a request's rows of all of them are
    gathered and updated together: fixed tables' rows one table after another, from
    ``inits``; dynamic tables' numbered by the id map's row group of their kind. The dynamic
    tables share one id map, so a request's ids of all of them cost one search and one insert
    (see :meth:`ServerShard.read`), and so one lock."""
    kinds: dict[tuple[object, ...], list[str]] = {}
    for name, spec in plan.tables.items():
        rule = rules[name]
        key = (spec.dynamic is not None, spec.dim, spec.dtype, type(rule), rule.config)
        kinds.setdefault(key, []).append(name)
    dynamic_kinds = [names for names in kinds.values() if plan.tables[names[0]].dynamic]
    groups = [group for group, names in enumerate(dynamic_kinds) for _ in names]
    id_map = FusedIdMap(len(groups), groups=groups)
    spaces = itertools.count()  # each dynamic table's space in the id map, in group order
    lock = threading.Lock()
    tables: dict[str, TableShard] = {}
    for names in kinds.values():
        specs = [plan.tables[name] for name in names]
        rule = rules[names[0]]
        if specs[0].dynamic is not None:
            arena = dynamic_arena(specs, rule, cache_lag)
            for name in names:
                shared = SharedRows(id_map.table(next(spaces)), lock, arena)
                tables[name] = DynamicTable(plan.tables[name], rules[name], cache_lag, shared)
            continue
        sizes = [len(range(server, spec.num_rows, plan.num_servers)) for spec in specs]
        arena = RowArena(
            specs[0].dim, specs[0].dtype, rule, versions=cache_lag is not None, rows=sum(sizes)
        )
        starts = itertools.accumulate(sizes, initial=0)
        for name, start in zip(names, starts, strict=False):
            place = (arena, start)
            tables[name] = FixedTable(
                plan.tables[name], plan, server, inits[name], rules[name], cache_lag, place
            )
    return {name: tables[name] for name in plan.tables}, id_map, lock
