"""A dynamic table: a server's rows of an embedding table keyed by any int64 id (hashed).

It answers the calls of :class:`~paramserver.store.table.TableShard`; this module holds what
only it does: admission (the counts of ids not admitted yet: store/admission.py), eviction, and
the records of which row each pull handed out (store/pulls.py); and the reads of several
dynamic tables at once (:func:`locate_together`, :func:`values_together`: a server's are
read together by :class:`~paramserver.store.dynamicgroup.DynamicTables`).

A row is created the first time an admitted id is pulled for training, initialized by
:func:`~paramserver.store.rowinit.init_rows` (a pure function of the table's seed and the
id, so it does not depend on the server or on arrival order), and kept in storage (shared with
the server's other dynamic tables of its kind) that grows by 15% at a time. Admission
(``min_count``): a training read admits an id pulled for training in ``min_count`` calls,
counting those of earlier steps of the table's clock and its own, not other calls of its own
step; until then only its counter exists and its rows read as the default vector. Eviction:
rows untouched for ``ttl_steps`` steps of the table's clock (in sync mode a round's step, 0 for
trainers' initial calls; otherwise the highest trainer step seen), and, above ``capacity``
rows, the least recently touched rows down to 95% of capacity, sparing the rows of the current
step unless they alone exceed it; an evicted row's storage is reused, and an evicted id that
returns starts again from the init rule. Reads that do not train (evaluation, the ``pull``
call) create and count nothing: unseen ids read as the default vector.

So every training read at step ``t`` admits the same ids whatever the order of that step's
reads, and none evicts a row another read of step ``t`` handed out. Trainers' first calls
(step 0, with nothing older to evict) then answer alike in any order, at clock 0 even after a
faster trainer's call 1 arrived (not at the highest step seen, which depends on arrival), and
a sync round answers in trainer order: a sync job is reproducible, and a checkpoint taken after
round ``t``'s answers holds every row as each trainer read it, so a resumed trainer reads call
``t`` again from it without counting it (a :class:`~paramserver.store.table.Reading` with a
``pull`` but not ``train``).

Versions: a row created anew starts ``cache_lag + 1`` past any version an evicted row reached,
so no copy a trainer cached before an eviction passes for fresh.

Gradients go to the rows they were computed from, or nowhere. A read for a ``pull`` (the
trainer and call number) keeps a record of the row each id had (-1: none, the id pending); a
row removed later is struck from every record. A push names the pull its gradients came from
(``apply``'s ``pull``, or ``rows_still_pulled`` before a sync round sums several trainers'): a
gradient whose id had no row at that pull (pending) or lost it since (evicted, even if admitted
again: the new row is not the one the gradient is of) is dropped and counted in
``dropped_grads``. A push whose pull left no record (one read outside a training pull, or older
than the last few pulls of its trainer) goes to the id's current row, if any.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from paramserver.embedding import DynamicOptions
from paramserver.errors import StoreError
from paramserver.optim import State, UpdateRule
from paramserver.rowupdates import apply_updates, take_rows
from paramserver.sharding import TableSpec
from paramserver.store.admission import PendingIds
from paramserver.store.arena import RowArena, by_arena, restore_rows, row_entries
from paramserver.store.changes import ChangeFeed
from paramserver.store.growth import grown_rows
from paramserver.store.idmap import Found, FusedIdMap, TableIds
from paramserver.store.pulls import PullRecords
from paramserver.store.rowinit import init_values_and_state, salt
from paramserver.store.table import Pull, Reading, TableUpdate

EVICT_TO = 0.95  # capacity eviction frees down to this fraction, so it runs once per 5% growth


@dataclass(frozen=True)
class SharedRows:
    """What a dynamic table shares with its server's other dynamic tables: its view of their
    one id map, their one lock, and the row storage of the tables of its kind (width, dtype
    and update rule), numbered by the id map's row group."""

    ids: TableIds
    lock: threading.Lock
    arena: RowArena
    changes: ChangeFeed


@dataclass
class TableCounters:
    admitted: int = 0
    evicted: int = 0
    lookups: int = 0
    dropped_grads: int = 0


class DynamicTable:
    """A table of hashed ids with admission and eviction; a :class:`TableShard`."""

    def __init__(
        self,
        spec: TableSpec,
        rule: UpdateRule,
        cache_lag: int | None = None,
        shared: SharedRows | None = None,
    ):
        """``shared``: what this table shares with its server's other dynamic tables (see
        :class:`SharedRows`); by default an id map, lock and row storage of its own."""
        assert spec.dynamic is not None
        self.spec = spec
        self.options: DynamicOptions = spec.dynamic
        self.rule = rule
        self.id_bounds = (-(2**63), 2**63 - 1)  # every int64 id is valid
        if shared is None:
            arena = dynamic_arena([spec], rule, cache_lag)
            shared = SharedRows(FusedIdMap(1).table(0), threading.Lock(), arena, ChangeFeed())
        self.ids = shared.ids
        self.changes = shared.changes
        self.lock = shared.lock
        # Storage grows with the rows that exist: a capacity is a bound, not a reservation.
        self.arena = shared.arena
        self.cache_lag = cache_lag
        self.fresh_version = 0  # where a new row's version starts
        self.init_salt = salt(spec.name, self.options)  # its rows' init: a constant per table
        self.pending = PendingIds()  # ids seen but not yet admitted
        self.counters = TableCounters()
        self.swept_at = 0
        self.pulls = PullRecords()  # each trainer's last training reads

    # Rows live in the arena (shared with the server's other dynamic tables of this kind),
    # at the row numbers the id map hands out; it may move as it grows, so it is read anew.

    @property
    def weight(self) -> Tensor:
        return self.arena.weight

    @property
    def state(self) -> State:
        return self.arena.state

    @property
    def steps(self) -> Tensor | None:
        return self.arena.steps

    @property
    def last_touched(self) -> Tensor | None:
        """When each row was last read or updated, kept only where eviction needs it (where
        this table or one sharing its arena evicts)."""
        return self.arena.last_touched if self.evicts else None

    @property
    def versions(self) -> Tensor | None:
        return self.arena.versions

    @property
    def evicts(self) -> bool:
        return self.options.ttl_steps is not None or self.options.capacity is not None

    # ---- calls ----

    def read(self, ids: Tensor, reading: Reading) -> Tensor:
        """The rows of ``ids`` (sorted, unique), the default vector where an id has none.

        A ``reading.train`` read admits, counts, touches and evicts (at ``reading.clock``);
        one for a ``reading.pull`` (the trainer and call whose gradients will come back for
        these rows) is recorded (see the module doc), also without ``train`` (a call read
        again).
        """
        return self.values(self._locate(ids, reading))

    def read_versioned(self, ids: Tensor, reading: Reading) -> tuple[Tensor, Tensor]:
        """:meth:`read`, and each row's version (-1 where an id has no row)."""
        rows = self._locate(ids, reading)
        return self.values(rows), self.versions_of(rows)

    def versions_of(self, rows: Tensor) -> Tensor:
        """The version of each of ``rows`` (-1 where a row is -1)."""
        assert self.versions is not None
        present = rows >= 0
        versions = torch.full_like(rows, -1)
        versions[present] = self.versions[rows[present]]
        return versions

    def _locate(self, ids: Tensor, reading: Reading) -> Tensor:
        """The row of each id (-1: none), after admitting, touching and evicting for a read
        that trains; recorded for the read's pull."""
        name = self.spec.name
        return locate_together({name: self}, {name: ids}, self.ids.fused, reading)[name]

    # The parts of a read particular to a table, for a server reading several dynamic tables
    # at once (one search and one insert in their shared id map, see DynamicTables.read).

    def settle(self, ids: Tensor, rows: Tensor, reading: Reading) -> Tensor:
        """After a read found or made ``rows`` for ``ids``: touch and evict (a training read),
        record them for the read's pull; returns the rows of ``ids`` now."""
        if reading.train:
            if self.last_touched is not None:
                held = rows >= 0
                self.last_touched[rows[held]] = reading.clock
                if self.changes.recovering:
                    self.changes.rows_touched(self.spec.name, ids[held])
            if _evict(self, reading.clock):  # spares this step's rows, unless they alone overflow
                rows = self.ids.lookup(ids)
        if reading.pull is not None:
            # Not copied: rows is this read's own (a slice of the rows it found for all its
            # tables, which no one changes), and the record's writes stay in its slice.
            self.pulls.record(reading.pull, ids, rows)
        return rows

    def values(self, rows: Tensor) -> Tensor:
        """The values of ``rows``; the default vector where a row is -1."""
        return values_together({self.spec.name: self}, {self.spec.name: rows})[self.spec.name]

    def apply(
        self, ids: Tensor, grads: Tensor, clock: int, pull: Pull | None = None, *, lr: float
    ) -> int:
        """Apply the gradients of ``ids`` (sorted, unique) computed from the read ``pull``
        (None: from the ids' current rows, as for a sync round's sum, whose parts were checked
        by :meth:`rows_still_pulled`) at learning rate ``lr``; returns the rows updated."""
        update = self.row_update(ids, grads, pull)
        apply_updates(self.rule, [update], lr)
        if update.ids.numel():
            self.changes.rows_written({self.spec.name: update.ids})
        return self.updated(update, clock)

    def row_update(self, ids: Tensor, grads: Tensor, pull: Pull | None) -> TableUpdate:
        """The rows of ``ids`` at the read ``pull`` (see :meth:`apply`); the gradients of ids
        without one are dropped (counted)."""
        rows = self._rows_at_pull(ids, pull) if pull is not None else None
        if rows is None:
            rows = self.ids.lookup(ids)
        present = rows.numpy() >= 0
        if not present.all():  # no row at the pull (pending), or it was removed since
            kept = torch.from_numpy(present)
            self.counters.dropped_grads += ids.numel() - int(present.sum())
            ids, rows, grads = ids[kept], rows[kept], grads[kept]
        return self.arena.update(rows, grads, ids)

    def updated(self, update: TableUpdate, clock: int) -> int:
        rows = update.rows
        if self.last_touched is not None:
            self.last_touched[rows] = clock
        if self.versions is not None:
            self.versions[rows] += 1
        return rows.numel()

    def rows_still_pulled(self, ids: Tensor, pull: Pull) -> Tensor | None:
        """Which gradients of ``ids`` (sorted, unique), computed from the read ``pull``, still
        have their row (a mask); counts the others as dropped. None where the pull left no
        record: keep all."""
        rows = self._rows_at_pull(ids, pull)
        if rows is None:
            return None
        kept = rows >= 0
        self.counters.dropped_grads += ids.numel() - int(kept.sum())
        return kept

    def rows_taking_update(self, ids: Tensor, rows: Tensor, pull: Pull) -> Tensor:
        """Which of ``rows`` (those of ``ids``, now) a gradient computed from the read
        ``pull`` would update: those that exist and are the rows that read handed out."""
        held = rows >= 0
        if self.pulls.all_rows_kept(pull):  # each id's row at the read is its row now
            return held
        then = self._rows_at_pull(ids, pull)
        return held if then is None else held & (then == rows)

    def _rows_at_pull(self, ids: Tensor, pull: Pull) -> Tensor | None:
        """The row each id had at the read ``pull`` and still has (-1: none); ids that read
        did not hand out get their current rows. None: no record."""
        return self.pulls.rows_at(ids, pull, self.ids.lookup)

    def held_ids(self) -> Tensor:
        return self.ids.live_rows()[0]

    def snapshot(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Copies of every live row with its state and bookkeeping, keyed by id, the pending
        ids' counters, and the counters (for checkpoints)."""
        ids, rows = self.ids.live_rows()
        entries = row_entries(
            ids, self.weight, self.state, self.steps, self.versions, rows, self.last_touched
        )
        entries.update(self.pending.snapshot())
        return entries, _books_of(self)

    def restore(self, saved: dict[str, Tensor], meta: dict[str, Any]) -> None:
        """Add the rows and pending ids of ``saved`` (this server's, from any shard layout)
        with their state; add its counters to this table's."""
        self.set_rows(saved)
        self.pending.restore(saved)
        _take_books(self, meta, added=True)

    def snapshot_of(
        self, ids: Tensor, pending: Tensor | None
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """:meth:`snapshot` of part of the table, for a recovery log: the rows of those of
        ``ids`` that have one, the counters of those of ``pending`` still pending (None: of
        all), the ids of ``pending`` now neither (``pending.forgotten``), and the table's
        counters."""
        rows = self.ids.lookup(ids)
        held = rows >= 0
        entries = row_entries(
            ids[held], self.weight, self.state, self.steps, self.versions, rows[held],
            self.last_touched,
        )  # fmt: skip
        entries.update(self.pending.snapshot(among=pending, rows=self.ids))
        return entries, _books_of(self)

    def replay(self, saved: dict[str, Tensor], meta: dict[str, Any]) -> None:
        """Set the rows and pending ids of ``saved`` (:meth:`snapshot_of`'s), forget its
        forgotten ones, and take its counters (they are the table's then, not a part's)."""
        self.set_rows(saved)
        self.pending.replay(saved)
        _take_books(self, meta, added=False)

    def set_rows(self, entries: Mapping[str, Tensor]) -> None:
        """Set the rows of ``entries["ids"]`` (unique), making those of ids without one (no
        longer pending: they are rows now)."""
        ids = entries["ids"]
        if not ids.numel():
            return
        if ids.dtype != torch.int64 or ids.dim() != 1 or ids.unique().numel() != ids.numel():
            raise StoreError(f"table {self.spec.name!r}: rows set need unique 1-D int64 ids")
        rows = self.ids.lookup(ids)
        absent = rows < 0
        if bool(absent.any()):
            self.pending.remove(ids[absent])
            rows[absent] = self.ids.insert(ids[absent])
            self.fit_rows()
        restore_rows(rows, entries, self.weight, self.state, self.steps, self.versions)
        if self.last_touched is not None and "last_touched" in entries:
            self.last_touched[rows] = entries["last_touched"]
        self.changes.rows_written({self.spec.name: ids})

    def delete_ids(self, ids: Tensor) -> None:
        """Remove the rows of those of ``ids`` that have one, as an eviction does (counted as
        evicted; a gradient computed from a removed row is dropped)."""
        self.remove_rows(ids[self.ids.lookup(ids) >= 0])

    def nbytes(self) -> int:
        """This table's bytes: its pending ids', and its share of the arena's and the id
        map's by its share of their live rows."""
        live = self.ids.group_rows
        arena = self.arena.nbytes() * self.ids.num_rows // live if live else 0
        return arena + self.ids.nbytes() + self.pending.nbytes()

    def stats(self) -> dict[str, int]:
        return {
            "rows": self.ids.num_rows,
            "admitted": self.counters.admitted,
            "evicted": self.counters.evicted,
            "lookups": self.counters.lookups,
            "pending_ids": self.pending.num_ids,
            "dropped_grads": self.counters.dropped_grads,
            "memory_bytes": self.nbytes(),
            "id_map_bytes": self.ids.nbytes(),
        }

    # ---- admission and eviction ----

    def fit_rows(self) -> None:
        """Grow the arena to every row number the id map has handed out in it."""
        arena, needed = self.arena, self.ids.used_rows
        if needed > arena.num_rows:
            capacity = grown_rows(arena.num_rows, needed)
            if arena.max_rows is not None:  # grow no further than the bounds need
                capacity = max(needed, min(capacity, arena.max_rows))
            arena.grow(capacity)

    def remove_rows(self, ids: Tensor) -> None:
        """Remove the rows of ``ids`` (each with one), as its rules do: counted as evicted."""
        if ids.numel():
            rows = self.ids.remove(ids)
            self.counters.evicted += ids.numel()
            if self.versions is not None and self.cache_lag is not None and rows.numel():
                reached = int(self.versions[rows].max())
                self.fresh_version = max(self.fresh_version, reached + self.cache_lag + 1)
            self.pulls.strike(rows)
            self.changes.ids_removed(self.spec.name, ids)


def _evict(table: DynamicTable, clock: int) -> bool:
    """Apply ``table``'s TTL and capacity rules at step ``clock``; returns whether any row
    went."""
    if table.last_touched is None:  # neither rule is configured
        return False
    evicted_before = table.counters.evicted
    ttl = table.options.ttl_steps
    if ttl is not None and clock - table.swept_at >= max(1, ttl // 4):
        table.swept_at = clock
        ids, rows = table.ids.live_rows()
        stale = table.last_touched[rows] < clock - ttl
        table.remove_rows(ids[stale])
        forgotten = table.pending.expire(before=clock - ttl)
        if table.changes.recovering:
            table.changes.pending_changed(table.spec.name, forgotten)
    capacity = table.options.capacity
    if capacity is not None and table.ids.num_rows > capacity:
        ids, rows = table.ids.live_rows()
        # Least recently touched first; ties go to the smaller id, so eviction is exact.
        touched = table.last_touched[rows]
        order = torch.argsort(touched, stable=True)
        earlier = int((touched < clock).sum())  # rows of earlier steps come first
        excess = ids.numel() - int(capacity * EVICT_TO)
        # This step's rows go only if they alone exceed capacity (down to it, not 95%).
        gone = max(min(excess, earlier), ids.numel() - capacity)
        table.remove_rows(ids[order[:gone]])
    return table.counters.evicted != evicted_before


def _books_of(table: DynamicTable) -> dict[str, Any]:
    """A table's counters and the clocks its rules keep, as a snapshot's metadata."""
    counters = dataclasses.asdict(table.counters)
    return {"counters": counters, "swept_at": table.swept_at, "fresh_version": table.fresh_version}


def _take_books(table: DynamicTable, meta: dict[str, Any], *, added: bool) -> None:
    """Take a snapshot's metadata: ``added`` to the table's (a restore, of one part of
    several), or as they are (a replay: the table's own at the time)."""
    for name, value in meta["counters"].items():
        setattr(table.counters, name, (getattr(table.counters, name) if added else 0) + int(value))
    swept_at, fresh_version = int(meta["swept_at"]), int(meta["fresh_version"])
    table.swept_at = max(table.swept_at, swept_at) if added else swept_at
    table.fresh_version = max(table.fresh_version, fresh_version) if added else fresh_version


def dynamic_arena(specs: Sequence[TableSpec], rule: UpdateRule, cache_lag: int | None) -> RowArena:
    """Empty, growing row storage for the dynamic tables ``specs`` (of one kind: width, dtype,
    ``rule``; see :func:`~paramserver.store.growth.regrown`), growing no further than their
    capacities sum to where each has one."""
    options = [spec.dynamic for spec in specs if spec.dynamic is not None]
    assert len(options) == len(specs) and specs
    capacities = [o.capacity for o in options if o.capacity is not None]
    return RowArena(
        specs[0].dim,
        specs[0].dtype,
        rule,
        touched=any(o.ttl_steps is not None or o.capacity is not None for o in options),
        versions=cache_lag is not None,
        empty=_empty_rows,
        max_rows=sum(capacities) if len(capacities) == len(options) else None,
    )


def _empty_rows(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    return torch.empty(shape, dtype=dtype)


class Located(dict[str, Tensor]):
    """The rows :func:`locate_together` found, by table; ``joined``: all of them end to end,
    in the tables' order (each table's a view of it), or None where a table's are not."""

    joined: Tensor | None = None


def locate_together(
    tables: Mapping[str, DynamicTable],
    wanted: Mapping[str, Tensor],
    shared: FusedIdMap,
    reading: Reading,
) -> Located:
    """The rows of the ids ``wanted`` of each table, as each table's own read locates them,
    for tables sharing the id map ``shared`` (their lock held): all their ids searched in one
    call, and their admitted ids inserted in one."""
    names = list(wanted)
    counts = [wanted[n].numel() for n in names]
    ids = torch.cat([wanted[n] for n in names])
    spaces = np.repeat(np.array([tables[n].ids.space for n in names], dtype=np.int16), counts)
    found = shared.find(spaces, ids)
    rows = found.rows
    starts = [0, *itertools.accumulate(counts)]
    if reading.train and bool((rows.numpy() < 0).any()):  # numpy: cheaper for a few thousand
        rows = _admit_absent(tables, wanted, ids, spaces, found, starts, reading.clock, shared)
    elif reading.train:  # every id has its row: nothing to admit, only lookups to count
        for name, count in zip(names, counts, strict=True):
            tables[name].counters.lookups += count
    each = rows.split_with_sizes(counts)  # Tensor.split: a slower Python wrapper of it
    located = Located()
    for name, part in zip(names, each, strict=True):
        located[name] = tables[name].settle(wanted[name], part, reading)
    # A table's rows are a view of all of them unless an eviction made it look them up again.
    if all(located[name] is part for name, part in zip(names, each, strict=True)):
        located.joined = rows
    return located


def values_together(
    tables: Mapping[str, DynamicTable],
    located: Mapping[str, Tensor],
    joined: Tensor | None = None,
) -> dict[str, Tensor]:
    """The values of each table's ``located`` rows, the default vector where a row is -1;
    those of tables sharing an arena taken in one call (the tensors are then views of one).
    ``joined``: all of ``located`` end to end in its order, if the caller has them so."""
    values: dict[str, Tensor] = {}
    groups = by_arena(tables, located)
    for names in groups:
        if joined is not None and len(groups) == 1:  # every table's rows, already in order
            rows = joined
        else:
            rows = torch.cat([located[name] for name in names])
        counts = [located[name].numel() for name in names]
        weight = tables[names[0]].arena.weight
        rows_array = rows.numpy()
        if not rows_array.size or int(rows_array.min()) >= 0:  # numpy: cheaper than torch here
            together = take_rows(weight, rows_array)
        else:  # the default vectors where an id has no row
            present = rows >= 0
            defaults = [tables[name].options.default_value for name in names]
            default = torch.tensor(defaults, dtype=weight.dtype)
            default = default.repeat_interleave(torch.tensor(counts)).unsqueeze(1)
            together = default.expand(-1, weight.shape[1]).clone()
            if bool(present.any()):
                together[present] = take_rows(weight, rows[present].numpy())
        values.update(zip(names, together.split_with_sizes(counts), strict=True))
    return values


def _admit_absent(
    tables: Mapping[str, DynamicTable],
    wanted: Mapping[str, Tensor],
    ids: Tensor,
    spaces: np.ndarray,
    found: Found,
    starts: list[int],
    clock: int,
    shared: FusedIdMap,
) -> Tensor:
    """:func:`locate_together`'s admission, for a training read some of whose ids (``ids``,
    the tables' ``wanted`` one after another from ``starts``) are absent: each table admits
    its absent ids (all of them, or, counting sightings, those seen ``min_count`` times), and
    the admitted ids of all tables are inserted in ``shared`` in one call and made
    (:func:`_make_rows`); returns the rows of ``ids`` now."""
    rows = found.rows
    names = list(wanted)
    absent = rows.numpy() < 0  # a new array: the admitted positions, once refined below
    for i, name in enumerate(names):
        table = tables[name]
        table.counters.lookups += starts[i + 1] - starts[i]
        if table.options.min_count > 1:  # admits only ids seen often enough
            part = absent[starts[i] : starts[i + 1]]
            seen_at = np.flatnonzero(part)
            if seen_at.size:
                sighted = wanted[name][torch.from_numpy(seen_at)]
                seen = table.pending.count_sightings(sighted, clock, table.options.min_count)
                if table.changes.recovering:
                    table.changes.pending_changed(name, sighted)
                part[seen_at] = seen.numpy()
    admit = np.flatnonzero(absent)
    if not admit.size:
        return rows
    # numpy from here: a few thousand ids, where each torch call would cost more.
    new_ids = ids.numpy()[admit]
    inserted = shared.insert(spaces[admit], torch.from_numpy(new_ids), found.subset(admit))
    new_rows = inserted.numpy()
    now = rows.numpy().copy()
    now[admit] = new_rows
    bounds = np.searchsorted(admit, starts).tolist()  # each table's admitted positions
    made = {name: (bounds[i], bounds[i + 1]) for i, name in enumerate(names)}
    _make_rows(
        tables, {n: span for n, span in made.items() if span[1] > span[0]}, new_ids, new_rows
    )
    return torch.from_numpy(now)


def _make_rows(
    tables: Mapping[str, DynamicTable],
    made: Mapping[str, tuple[int, int]],
    ids: np.ndarray,
    rows: np.ndarray,
) -> None:
    """Initialize the rows just inserted in the id map, ``ids`` and ``rows`` (``made[table]``:
    where a table's are in them): values from :func:`init_rows`, state at the rule's start,
    step counts at 0, versions at the table's fresh version; those of tables sharing an arena
    in one pass."""
    for names in by_arena(tables, made):
        first = tables[names[0]]
        first.fit_rows()  # the arena holds every row its group's tables were given
        arena = first.arena
        spans = [made[name] for name in names]
        counts = [end - start for start, end in spans]
        if all(a[1] == b[0] for a, b in itertools.pairwise(spans)):  # one run: views
            group_ids, group_rows = (x[spans[0][0] : spans[-1][1]] for x in (ids, rows))
        else:
            group_ids = np.concatenate([ids[start:end] for start, end in spans])
            group_rows = np.concatenate([rows[start:end] for start, end in spans])
        group = [tables[name] for name in names]
        salts = np.repeat(np.array([t.init_salt for t in group], dtype=np.int64), counts)
        scales = np.repeat(np.array([t.options.init_scale for t in group]), counts)
        init_values_and_state(arena, group_rows, group_ids, salts, scales)
        if arena.steps is not None:
            arena.steps.index_fill_(0, torch.from_numpy(group_rows), 0)
        if arena.versions is not None:
            fresh = np.repeat([t.fresh_version for t in group], counts)
            arena.versions[torch.from_numpy(group_rows)] = torch.from_numpy(fresh)
        made_ids = {}
        for name, table, (start, end) in zip(names, group, spans, strict=True):
            table.counters.admitted += end - start
            made_ids[name] = torch.from_numpy(ids[start:end])
        first.changes.rows_written(made_ids)
