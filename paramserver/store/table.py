"""A server's part of one embedding table: the contract every kind answers.

A table shard (:class:`TableShard`) holds rows with their optimizer state beside them (slot
tensors and per-row step counts indexed like the weight) and answers one server's calls for
them: ``id_bounds`` (validation), ``read`` and ``read_versioned`` (rows for ids),
``rows_still_pulled`` and ``apply`` (gradients of rows), ``snapshot`` and ``restore``
(checkpoints), ``nbytes`` and ``stats``. Two kinds answer it: ``FixedTable`` in
store/fixed.py (a row range, cyclic over servers) and ``DynamicTable`` in store/dynamic.py
(any int64 id, with admission and eviction).

What a read is for travels as one :class:`Reading` (training or not, the table's clock, the
pull it answers): a dynamic table admits, evicts and records by it; a fixed table's rows are
the same for every reading. A push names its pull for the same reason: a dynamic table applies
a gradient only to the row that pull handed out (store/dynamic.py says why).

Versions (kept when trainers cache rows, ``cache_lag`` set): each row counts the updates
applied to it, so a trainer's cached copy can be judged by how many updates it missed.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from paramserver.optim import UpdateRule
from paramserver.sharding import TableSpec
from paramserver.store.arena import RowArena, TableUpdate

Pull = tuple[int, int]  # (trainer, call number) of a training read, as a push names it


@dataclass(frozen=True)
class Reading:
    """What a read of table rows is for.

    ``train``: a training read, which may create, admit, count and evict rows of a dynamic
    table at step ``clock`` of the table's clock; other reads create and count nothing.
    ``pull``: the (trainer, call) whose gradients will come back for the rows read (None:
    none will), recorded so they go only to the rows this read handed out.
    """

    train: bool = False
    clock: int = 0
    pull: Pull | None = None


@dataclass
class RowsRead:
    """What a read of several tables answers: each table's rows (in the order of its ids), and
    where asked, each row's version and the optimizer state of the rows a mask picks (tables
    that share an arena together: :class:`StateRead`)."""

    values: dict[str, Tensor] = field(default_factory=dict)
    versions: dict[str, Tensor] = field(default_factory=dict)
    state: list[StateRead] = field(default_factory=list)


@dataclass
class StateRead:
    """The optimizer state of the rows the masks of ``names`` (tables sharing an arena)
    picked, ``counts`` of each, every table's end to end in ``parts``: a rule's slots,
    ``ROW_STEPS`` where it reads them and, where some row would not take the reader's
    pending update, ``ROW_HELD``: which would."""

    names: list[str]
    counts: list[int]
    parts: dict[str, Tensor]


@dataclass(frozen=True)
class ReadAsks:
    """What a read asks beyond the rows: the versions of the tables in ``versioned`` (kept
    where trainers cache rows), the state of the rows each of ``state_masks`` picks (a bool
    mask per table, aligned with its ids), and, with ``pending`` (the reader's pull whose
    gradients it has not pushed yet), which of those rows would take that push."""

    versioned: Collection[str] = ()
    state_masks: Mapping[str, Tensor] = field(default_factory=dict)
    pending: Pull | None = None


class TableGroup(Protocol):
    """Tables of one kind read together: a store's fixed tables, or its dynamic tables (which
    share one id map and lock). Each kind answers a read of many tables in as few calls as it
    can (one gather per arena, one id search for all dynamic tables)."""

    names: frozenset[str]

    @property
    def tables(self) -> Mapping[str, TableShard]:
        """The group's tables, by name."""
        ...

    def read(
        self, wanted: Mapping[str, Tensor], reading: Reading, asks: ReadAsks, into: RowsRead
    ) -> None:
        """Put in ``into`` the rows of ``wanted`` (its tables all of this group, each id tensor
        sorted, unique and valid) for ``reading``, with what ``asks`` asks."""
        ...


class TableShard(Protocol):
    """A server's rows of one embedding table, as the store calls them.

    Thread-safety: no method locks; the caller holds :attr:`lock` around every call and
    every use of :attr:`weight` but its dtype (:attr:`id_bounds` never changes).
    Ids given are a non-empty 1-D int64 tensor, valid (within :attr:`id_bounds`); where
    a method says sorted and unique, the caller has checked it. Returned tensors are new
    (copies), owned by the caller; tensors given are only read, and kept only where a method
    says so.
    """

    spec: TableSpec
    lock: threading.Lock
    rule: UpdateRule  # the table's update rule, with its learning-rate schedule
    arena: RowArena  # the storage it shares with the server's other tables of its kind
    id_bounds: tuple[int, int]  # the least and the greatest valid id (fixed: its rows)

    @property
    def weight(self) -> Tensor:
        """The row storage: its dtype is the rows' (a dynamic table's has spare rows)."""
        ...

    def read(self, ids: Tensor, reading: Reading) -> Tensor:
        """The rows of ``ids`` (sorted, unique), ``[len(ids), dim]``, for ``reading``
        (which a dynamic table admits, evicts and records by; its ids are kept by the
        table as the pull's record)."""
        ...

    def read_versioned(self, ids: Tensor, reading: Reading) -> tuple[Tensor, Tensor]:
        """:meth:`read`, and each row's version (int64; -1 for an id without a row). Only
        with versions kept (``cache_lag`` set)."""
        ...

    def rows_still_pulled(self, ids: Tensor, pull: Pull) -> Tensor | None:
        """Which gradients of ``ids`` (sorted, unique), computed from the read ``pull``, still
        have that read's row (a bool mask; the others counted as dropped). None: keep all."""
        ...

    def apply(
        self, ids: Tensor, grads: Tensor, clock: int, pull: Pull | None = None, *, lr: float
    ) -> int:
        """One update of the rows of ``ids`` (sorted, unique) with ``grads`` (decoded,
        ``[len(ids), dim]``), computed from the read ``pull`` (None: from the rows' current
        values, as a sync round's sum checked by :meth:`rows_still_pulled`), at step
        ``clock`` of the table's clock, at learning rate ``lr`` (the schedule's, for the
        gradients' training step); returns the rows updated. :meth:`row_update`, the rule's
        step (:func:`~paramserver.rowupdates.apply_updates`) and :meth:`updated`, and the change
        told."""
        ...

    def row_update(self, ids: Tensor, grads: Tensor, pull: Pull | None) -> TableUpdate:
        """The first part of :meth:`apply`: the rows ``grads`` go to (a dynamic table drops
        those whose row ``pull`` did not hand out), with the table's storage; changes nothing
        but counters. A store applies the updates of all its tables of one rule at once."""
        ...

    def updated(self, update: TableUpdate, clock: int) -> int:
        """The last part of :meth:`apply`, once ``update`` (from :meth:`row_update`) has been
        applied at step ``clock``: versions and touches; returns the rows updated. The caller
        tells the change feed (:meth:`apply` itself; a store once for all its tables)."""
        ...

    def set_rows(self, entries: Mapping[str, Tensor]) -> None:
        """Set rows as they were saved (entries as :meth:`snapshot` has them: ``ids``,
        ``value``, ``state.<slot>``, ``steps``, ``versions``, ``last_touched``; the ids this
        server's), with their optimizer state and counts: what a restore and a replay do. A
        dynamic table makes the rows of ids it does not hold."""
        ...

    def delete_ids(self, ids: Tensor) -> None:
        """Remove the rows of ``ids`` (those held; a dynamic table's only, a fixed table's
        rows cannot go: raises StoreError), as an eviction would."""
        ...

    def held_ids(self) -> Tensor:
        """The ids of every row this server holds, sorted (a fixed table's global row ids)."""
        ...

    def snapshot(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Copies of every row with its state, keyed by global row id or id (``"ids"``), and
        JSON-ready metadata (for checkpoints)."""
        ...

    def restore(self, saved: dict[str, Tensor], meta: dict[str, Any]) -> None:
        """Take this server's rows of ``saved`` and ``meta`` (from :meth:`snapshot`, of any
        shard layout); copies them."""
        ...

    def snapshot_of(
        self, ids: Tensor, pending: Tensor | None
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """:meth:`snapshot` of part of the table, for a recovery log: the rows of ``ids``
        (sorted, unique) that exist, and a dynamic table's pending ids among ``pending`` (None:
        all) and its counters."""
        ...

    def replay(self, saved: dict[str, Tensor], meta: dict[str, Any]) -> None:
        """Take a :meth:`snapshot_of` of this table, as it was then (counters included)."""
        ...

    def nbytes(self) -> int:
        """Bytes of every tensor the table holds."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters for the job summary (``rows``, ``memory_bytes``, and a kind's own)."""
        ...


@contextmanager
def holding(locks: Iterable[threading.Lock]) -> Iterator[None]:
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
