"""What a training server publishes: the changes its store reports, gathered between cuts, and
a cut that turns them into a segment of current values.

A :class:`ChangeCollector` is the store's change observer
(:class:`~paramserver.store.changes.ChangeObserver`): it keeps the ids each report names (a
copy, in the feed's order) and the dense parameters written, and does nothing else under the
feed's lock. :func:`cut` takes what it gathered (the collector starts over) and reads, for
every id whose last change was a write, its row's current value; an id whose last change was
a removal becomes a tombstone. Values are read after the take, so a row changed again in
between is published with its newer value (and again in the next segment): a segment's
values are never older than the changes it covers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from paramserver.changelog.segment import Recovery, Segment, TableChanges
from paramserver.store.arena import ROW_STEPS
from paramserver.store.store import Store
from paramserver.store.table import Reading


@dataclass
class Changed:
    """What changed since the previous take: per table, the ids whose last change wrote their
    row and those whose last change removed it (each sorted and unique); the dense parameters
    written; the store's changes it covers: after ``after_changes``, up to ``changes``."""

    written: dict[str, Tensor] = field(default_factory=dict)
    removed: dict[str, Tensor] = field(default_factory=dict)
    # Recovery only: ids whose rows a read touched, pending ids counted or forgotten.
    touched: dict[str, Tensor] = field(default_factory=dict)
    pending: dict[str, Tensor | None] = field(default_factory=dict)
    dense: list[str] = field(default_factory=list)
    after_changes: int = 0
    changes: int = 0
    first_change_at: float = 0.0  # time.time() of its oldest change (0: none)


class ChangeCollector:
    """A store's changes since the last :meth:`take` (see the module doc); with ``recovers``,
    also the touches and pending ids recovery needs. Where a table's reports hold over
    ``compact_at`` ids (no cut for long: its writing stalls), they are folded into each id's
    last change, so what it keeps is bounded by the ids changed."""

    def __init__(self, compact_at: int = 1 << 20, *, recovers: bool = False) -> None:
        self.recovers = recovers
        self._lock = threading.Lock()
        self._compact_at = compact_at
        self._events: dict[str, list[tuple[Tensor, bool]]] = {}
        self._held: dict[str, int] = {}  # ids in each table's events
        self._marked: dict[tuple[str, str], list[Tensor]] = {}  # (kind, table): ids
        self._dense: set[str] = set()
        self._changes = self._taken = 0
        self._first_change_at = 0.0

    def starts_after(self, sequence: int) -> None:
        """The store's change sequence when this was attached (where the first take starts)."""
        with self._lock:
            self._changes = self._taken = max(self._changes, sequence)

    def rows_written(self, table: str, ids: Tensor, sequence: int) -> None:
        self._add(table, ids, True, sequence)

    def ids_removed(self, table: str, ids: Tensor, sequence: int) -> None:
        self._add(table, ids, False, sequence)

    def dense_written(self, names: Sequence[str], sequence: int) -> None:
        with self._lock:
            self._dense.update(names)
            self._changes = sequence
            self._first_change_at = self._first_change_at or time.time()

    def rows_touched(self, table: str, ids: Tensor, sequence: int) -> None:
        self._mark("touched", table, ids, sequence)

    def pending_changed(self, table: str, ids: Tensor, sequence: int) -> None:
        self._mark("pending", table, ids, sequence)

    def _mark(self, kind: str, table: str, ids: Tensor, sequence: int) -> None:
        copy = ids.clone()
        with self._lock:
            marked = self._marked.setdefault((kind, table), [])
            marked.append(copy)
            if len(marked) > 256:  # kept whole, the reports' ids would grow without bound
                self._marked[(kind, table)] = [torch.cat(marked).unique()]
            self._changes = sequence
            self._first_change_at = self._first_change_at or time.time()

    def _add(self, table: str, ids: Tensor, written: bool, sequence: int) -> None:
        copy = ids.clone()  # the caller's, which it may reuse
        with self._lock:
            events = self._events.setdefault(table, [])
            events.append((copy, written))
            self._held[table] = self._held.get(table, 0) + copy.numel()
            if self._held[table] > self._compact_at:
                kept, dropped = _last_changes(events)  # disjoint: their order no longer matters
                self._events[table] = [(kept, True), (dropped, False)]
                self._held[table] = kept.numel() + dropped.numel()
                self._compact_at = max(self._compact_at, 2 * self._held[table])
            self._changes = sequence
            self._first_change_at = self._first_change_at or time.time()

    def has_changes(self) -> bool:
        """Whether anything changed since the last take."""
        with self._lock:
            return self._changes != self._taken  # every report numbers a change

    def take(self) -> Changed:
        """What changed since the last take, each id's last change deciding its fate."""
        with self._lock:
            events, self._events, self._held = self._events, {}, {}
            marked, self._marked = self._marked, {}
            dense, self._dense = self._dense, set()
            after, changes, first = self._taken, self._changes, self._first_change_at
            self._taken, self._first_change_at = changes, 0.0
        changed = Changed(dense=sorted(dense), after_changes=after, changes=changes)
        changed.first_change_at = first
        for table, table_events in events.items():
            changed.written[table], changed.removed[table] = _last_changes(table_events)
        for (kind, table), ids in marked.items():
            into = changed.touched if kind == "touched" else changed.pending
            into[table] = torch.cat(ids).unique()
        return changed


def _last_changes(events: list[tuple[Tensor, bool]]) -> tuple[Tensor, Tensor]:
    """The ids whose last event wrote their row, and those whose last event removed it."""
    ids = torch.cat([ids for ids, _ in events])
    wrote = torch.cat([torch.full((ids.numel(),), written) for ids, written in events])
    unique, inverse = torch.unique(ids, return_inverse=True)
    order = torch.arange(ids.numel())
    last = torch.full((unique.numel(),), -1, dtype=torch.int64)
    last.scatter_reduce_(0, inverse, order, reduce="amax")
    final = wrote[last]
    return unique[final], unique[~final]


def cut(store: Store, collector: ChangeCollector, first_step: int, last_step: int) -> Segment:
    """A segment of what ``collector`` gathered from ``store`` (see the module doc), covering
    steps ``first_step`` to ``last_step``; its place in a chain is the log writer's to set."""
    changed = collector.take()
    written = {name: ids for name, ids in changed.written.items() if ids.numel()}
    values = store.read(written, Reading()).values if written else {}
    segment = Segment(
        "",
        store.server,
        0,
        0,
        first_step,
        last_step,
        changed.after_changes,
        changed.changes,
        cut_at=time.time(),
        first_change_at=changed.first_change_at,
        servers=store.plan.num_servers,
    )
    if collector.recovers:
        segment.recovery = recovery_of(store, changed)
    for name in changed.written:
        ids, removed = changed.written[name], changed.removed[name]
        table_values = values.get(name)
        if table_values is None:
            table_values = torch.zeros(0, store.tables[name].spec.dim)
        segment.tables[name] = TableChanges(ids, table_values, removed)
    segment.dense = store.read_dense(changed.dense).values if changed.dense else {}
    return segment


def attach_collector(store: Store, recovers: bool = False) -> ChangeCollector:
    """A collector attached to ``store``'s change feed, from its next change on (with
    ``recovers``: recording for recovery too)."""
    collector = ChangeCollector(recovers=recovers)
    collector.starts_after(store.changes.attach(collector))
    return collector


def full_cut(store: Store, collector: ChangeCollector, first_step: int, last_step: int) -> Segment:
    """A full segment of ``store``: every row and dense value it holds now, covering the steps
    ``first_step`` to ``last_step``; what ``collector`` gathered so far is in it (taken)."""
    changed = collector.take()
    names = list(store.tables)
    held = {name: store.held_ids(name) for name in names}
    values = store.read({n: ids for n, ids in held.items() if ids.numel()}, Reading()).values
    segment = Segment(
        "", store.server, 0, 0, first_step, last_step, 0, changed.changes,
        cut_at=time.time(), first_change_at=changed.first_change_at,
        servers=store.plan.num_servers, full=True,
    )  # fmt: skip
    for name in names:
        dim = store.tables[name].spec.dim
        rows = values.get(name, torch.zeros(0, dim))
        segment.tables[name] = TableChanges(held[name], rows, torch.zeros(0, dtype=torch.int64))
    segment.dense = store.read_dense(list(store.dense)).values if store.dense else {}
    if collector.recovers:  # the whole store: every row, every pending id
        whole = Changed(written=held, pending=dict.fromkeys(names), dense=list(store.dense))
        segment.recovery = recovery_of(store, whole)
    return segment


_NO_IDS = torch.empty(0, dtype=torch.int64)


def recovery_of(store: Store, changed: Changed) -> Recovery:
    """The recovery section (:mod:`paramserver.changelog.recover`) of a cut of ``store`` that
    took ``changed``, read now (so never older than the changes it covers): each row written
    or touched whole, the pending ids counted or forgotten (None for a table: all of them),
    every dynamic table's counters, the dense values written with their state, the clock."""
    recovery = Recovery(store.clock)
    for name in store.tables:
        written = changed.written.get(name, _NO_IDS)
        touched = changed.touched.get(name, _NO_IDS)
        rows = torch.cat([written, touched]).unique() if touched.numel() else written
        pending = changed.pending.get(name, _NO_IDS)
        entries, meta = store.snapshot_of(name, rows, pending)
        if rows.numel() or pending is None or pending.numel() or meta:
            recovery.tables[name], recovery.meta[name] = entries, meta
    dense = store.read_dense(changed.dense, state=True)
    for name, value in dense.values.items():
        state = dict(dense.state[name])
        version = state.pop(ROW_STEPS)
        slots = {f"state.{slot}": tensor for slot, tensor in state.items()}
        recovery.dense[name] = {"value": value, **slots, "version": version}
    return recovery
