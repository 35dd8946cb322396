"""A server's parameters: its dense values and its rows of every table, each with its optimizer
state beside it. Every read and every change of them goes through :class:`Store`: the
server's requests, the single-process baseline, checkpoints and their restore.

The interface, in the store's own terms (ids, rows, gradients; never a message):

- :meth:`Store.read`: ids per table in, rows out (with versions and optimizer state where
  asked), for a :class:`~paramserver.store.table.Reading` that says what the read is for;
- :meth:`Store.apply_rows` and :meth:`Store.apply_dense`: ids and gradients in, one update;
- :meth:`Store.set_rows` and :meth:`Store.delete_ids`: rows set with their state (a restore,
  a replay) and ids removed;
- :attr:`Store.changes`: every change, numbered (:mod:`paramserver.store.changes`).

Behind it, each kind of table (fixed, dynamic) is a
:class:`~paramserver.store.table.TableShard`, and the tables of a kind are read together by
their :class:`~paramserver.store.table.TableGroup`; the store picks the group, never the kind.

Thread-safety: every method may be called from many threads at once. Each dense value and
each table has a lock held while its values or state are read or written. An update holds the
locks of everything it updates together (one optimizer call serves all the tables of a rule),
taken in one global order (:func:`~paramserver.store.table.holding`), so two updates cannot
deadlock; no method waits for another call.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from paramserver.errors import StoreError
from paramserver.optim import Block, Empty, State, UpdateRule, make_rule
from paramserver.optimconfig import OptimizerConfig
from paramserver.rowupdates import apply_updates
from paramserver.sharding import ShardPlan, TableSpec
from paramserver.store.arena import ROW_STEPS
from paramserver.store.changes import ChangeFeed
from paramserver.store.dynamicgroup import DynamicTables, dynamic_tables
from paramserver.store.fixed import FixedTable, FixedTables, fixed_tables
from paramserver.store.table import (
    Pull,
    ReadAsks,
    Reading,
    RowsRead,
    TableGroup,
    TableShard,
    TableUpdate,
    holding,
)
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
class DenseRead:
    """Copies of dense values, each with its version (updates applied) and, where asked, its
    optimizer state by part (its rule's slots and ``ROW_STEPS``, its count of updates)."""

    values: dict[str, Tensor] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    state: dict[str, dict[str, Tensor]] = field(default_factory=dict)


class Store:
    """Server ``server``'s dense values and table rows (see the module doc)."""

    def __init__(
        self,
        server: int,
        plan: ShardPlan,
        dense: Mapping[str, Tensor],
        table_inits: Mapping[str, RowInit],
        dense_rule: OptimizerConfig,
        table_rules: Mapping[str, OptimizerConfig],
        cache_lag: int | None = None,
        fixed_storage: Empty | None = None,
    ):
        """``dense`` holds the starting values of the dense parameters and of the buffers
        (those placed here are copied; a buffer's slot has no optimizer state), ``table_inits``
        how each fixed table's rows start (this server makes its own rows only); dynamic tables
        start empty. ``cache_lag``: where trainers cache rows, the
        lag they are served with (rows then keep versions). ``fixed_storage``: where fixed
        tables' rows are allocated (by default :func:`~paramserver.store.growth.row_storage`;
        serving maps them from files: :func:`~paramserver.store.growth.file_backed`)."""
        self.server = server
        self.plan = plan
        self.cache_lag = cache_lag
        self.changes = ChangeFeed()
        self.dense: dict[str, DenseSlot] = {}
        for name in plan.dense_on(server):
            value = dense[name].detach().clone().contiguous()
            rule = make_rule(dense_rule)
            self.dense[name] = DenseSlot(value, rule, rule.init_state(value))
        self.buffers = frozenset(plan.buffers_on(server))  # in ``dense``, never stepped
        for name in sorted(self.buffers):
            self.dense[name] = DenseSlot(
                dense[name].detach().clone().contiguous(), make_rule(dense_rule), {}
            )
        rules = {name: make_rule(table_rules[name]) for name in plan.tables}
        self.groups = make_groups(
            plan, server, table_inits, rules, cache_lag, self.changes, fixed_storage
        )
        made = {name: t for group in self.groups for name, t in group.tables.items()}
        self.tables: dict[str, TableShard] = {name: made[name] for name in plan.tables}
        self.clock = 0  # the highest call number seen: dynamic tables' time
        self._clock_lock = threading.Lock()

    def advance_clock(self, call: int) -> int:
        with self._clock_lock:
            self.clock = max(self.clock, call)
            return self.clock

    # ---- reading ----

    def read(
        self, wanted: Mapping[str, Tensor], reading: Reading, asks: ReadAsks | None = None
    ) -> RowsRead:
        """The rows of ``wanted`` (ids per table: sorted, unique, valid) for ``reading``, with
        what ``asks`` asks (versions, state); copies, owned by the caller."""
        asks = asks or ReadAsks()
        into = RowsRead()
        for group in self.groups:
            part = {name: ids for name, ids in wanted.items() if name in group.names}
            if part:
                group.read(part, reading, asks, into)
        return into

    def read_dense(self, names: Collection[str] | None = None, state: bool = False) -> DenseRead:
        """Copies of the dense values ``names`` (by default the parameters held here, not the
        buffers), with their versions (a buffer's: the times it was set) and, with ``state``,
        their optimizer state."""
        read = DenseRead()
        if names is None:
            names = [name for name in self.dense if name not in self.buffers]
        for name in names:
            slot = self.dense[name]
            with slot.lock:
                read.values[name] = slot.value.clone()
                read.versions[name] = int(slot.version)
                if state:
                    parts = {part: v.clone() for part, v in slot.state.items()}
                    parts[ROW_STEPS] = slot.version.clone()
                    read.state[name] = parts
        return read

    # ---- updating ----

    def learning_rates(
        self, step: int, dense: Collection[str], tables: Collection[str]
    ) -> tuple[float, dict[str, float]]:
        """The lr of training step ``step`` for the dense values (group ``"dense"``: one rule
        for all) and for each of ``tables``; raises ConfigError naming the group and the step
        where a schedule gives no valid factor."""
        dense_lr = self.dense[next(iter(dense))].rule.lr_at(step, "dense") if dense else 0.0
        return dense_lr, {name: self.tables[name].rule.lr_at(step, name) for name in tables}

    def apply_dense(self, grads: Mapping[str, Tensor], lr: float) -> None:
        """One step of the dense rule over every gradient of ``grads`` (one torch.optim call
        where the rule allows it), their locks held together."""
        slots = {name: self.dense[name] for name in grads}
        blocks = [
            Block(slot.value, grads[name], slot.state, slot.version) for name, slot in slots.items()
        ]
        with holding([slot.lock for slot in slots.values()]):
            next(iter(slots.values())).rule.step_blocks(blocks, lr)
            self.changes.dense_written(list(grads))

    def apply_rows(
        self,
        grads: Mapping[str, tuple[Tensor, Tensor]],
        lrs: Mapping[str, float],
        clock: int,
        pull: Pull | None = None,
    ) -> int:
        """One update of each table's rows of ``grads`` (ids sorted and unique, gradients
        ``[len(ids), dim]``), computed from the read ``pull`` (None: from the rows' current
        values, as a sync round's sum checked by :meth:`rows_still_pulled`), at step ``clock``
        of the tables' clock, at each table's lr of ``lrs``. The tables of one rule and lr
        are stepped together, their locks held together; returns the rows updated (one change
        told for all)."""
        tables = {name: self.tables[name] for name in grads}
        with holding([table.lock for table in tables.values()]):
            updates: dict[str, TableUpdate] = {}
            together: dict[tuple[object, ...], list[str]] = {}
            for name, (ids, table_grads) in grads.items():
                table = tables[name]
                updates[name] = table.row_update(ids, table_grads, pull)
                key = (type(table.rule), table.rule.config, lrs[name])
                together.setdefault(key, []).append(name)
            for names in together.values():
                rule = tables[names[0]].rule  # the same rule as the others'
                apply_updates(rule, [updates[name] for name in names], lrs[names[0]])
            updated = 0
            for name, update in updates.items():
                updated += tables[name].updated(update, clock)
            if updated:
                self.changes.rows_written({name: update.ids for name, update in updates.items()})
            return updated

    def set_dense(
        self, name: str, value: Tensor, state: Mapping[str, Tensor], version: Tensor
    ) -> None:
        """Set dense value ``name`` with its optimizer state (by slot) and its count of
        updates, as a snapshot has them."""
        slot = self.dense.get(name)
        if slot is None:
            raise StoreError(f"server {self.server} holds no dense parameter {name!r}")
        with slot.lock:
            slot.value.copy_(value)
            for key, part in slot.state.items():
                part.copy_(state[key])
            slot.version.copy_(version)
            self.changes.dense_written([name])

    def set_buffers(self, values: Mapping[str, Tensor]) -> None:
        """Set buffers held here to ``values`` (validated: names, shapes and dtypes), each
        counted as one change."""
        slots = {name: self.dense[name] for name in values}
        with holding([slot.lock for slot in slots.values()]):
            for name, slot in slots.items():
                slot.value.copy_(values[name])
                slot.version += 1
            self.changes.dense_written(list(values))

    def rows_still_pulled(self, table: str, ids: Tensor, pull: Pull) -> Tensor | None:
        """Which gradients of ``table``'s ``ids``, computed from the read ``pull``, still have
        that read's rows (a mask; the others counted as dropped); None: all do."""
        shard = self.tables[table]
        with shard.lock:
            return shard.rows_still_pulled(ids, pull)

    def set_rows(self, table: str, entries: Mapping[str, Tensor]) -> None:
        """Set ``table``'s rows of ``entries`` (as a snapshot has them) with their state."""
        shard = self._table(table)
        with shard.lock:
            shard.set_rows(entries)

    def delete_ids(self, table: str, ids: Tensor) -> None:
        """Remove ``table``'s rows of ``ids`` (a dynamic table's; absent ids are ignored)."""
        shard = self._table(table)
        with shard.lock:
            shard.delete_ids(ids)

    def snapshot_of(
        self, table: str, ids: Tensor, pending: Tensor | None
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """A snapshot of part of ``table`` (see :meth:`TableShard.snapshot_of`)."""
        shard = self._table(table)
        with shard.lock:
            return shard.snapshot_of(ids, pending)

    def replay(self, table: str, saved: dict[str, Tensor], meta: dict[str, Any]) -> None:
        """Take a :meth:`snapshot_of` of ``table`` (see :meth:`TableShard.replay`)."""
        shard = self._table(table)
        with shard.lock:
            shard.replay(saved, meta)

    def held_ids(self, table: str) -> Tensor:
        """The ids of every row of ``table`` this server holds (sorted)."""
        shard = self._table(table)
        with shard.lock:
            return shard.held_ids()

    def _table(self, name: str) -> TableShard:
        table = self.tables.get(name)
        if table is None:
            raise StoreError(f"server {self.server} holds no table {name!r}")
        return table

    # ---- whole-store views, for export, tests and the summary ----

    def export_state(self, with_optimizer: bool = False) -> dict[str, dict[str, Tensor]]:
        """Copies of every value (and optionally optimizer state and step counts); table rows
        keyed by global row id or id (``"ids"``), as :meth:`TableShard.snapshot` has them."""
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

    def table_stats(self) -> dict[str, dict[str, int]]:
        result = {}
        for name, table in self.tables.items():
            with table.lock:
                result[name] = table.stats()
        return result

    def state_hash(self) -> str:
        """A digest of every value, state slot and step count held here."""
        digest = hashlib.sha256()
        for name, entry in sorted(self.export_state(with_optimizer=True).items()):
            for key, tensor in sorted(entry.items()):
                digest.update(f"{name}/{key}".encode())
                digest.update(tensor.contiguous().numpy().tobytes())
        return digest.hexdigest()


def make_groups(
    plan: ShardPlan,
    server: int,
    inits: Mapping[str, RowInit],
    rules: Mapping[str, UpdateRule],
    cache_lag: int | None,
    changes: ChangeFeed,
    fixed_storage: Empty | None = None,
) -> list[TableGroup]:
    """This server's shards of the tables of ``plan``, each with its update rule from
    ``rules``, in their groups: the dynamic tables (read first), then the fixed ones.

    Tables of one kind (fixed or dynamic, width, dtype, update rule) keep their rows in one
    :class:`~paramserver.store.arena.RowArena`, so a request's rows of all of them are
    gathered and updated together: fixed tables' rows one table after another, from
    ``inits``; dynamic tables' numbered by the id map's row group of their kind. The dynamic
    tables share one id map, so a request's ids of all of them cost one search and one insert,
    and so one lock."""
    kinds: dict[tuple[object, ...], list[TableSpec]] = {}
    for name, spec in plan.tables.items():
        rule = rules[name]
        key = (spec.dynamic is not None, spec.dim, spec.dtype, type(rule), rule.config)
        kinds.setdefault(key, []).append(spec)
    dynamic_kinds = [specs for specs in kinds.values() if specs[0].dynamic is not None]
    fixed: dict[str, FixedTable] = {}
    for specs in kinds.values():
        if specs[0].dynamic is None:
            of_kind = {spec.name: spec for spec in specs}
            fixed.update(
                fixed_tables(of_kind, plan, server, inits, rules, cache_lag, changes, fixed_storage)
            )
    dynamic: DynamicTables = dynamic_tables(dynamic_kinds, rules, cache_lag, changes)
    return [dynamic, FixedTables(fixed)]
