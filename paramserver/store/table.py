"""A server's part of one embedding table: the contract every kind answers, and fixed tables.

A table shard (:class:`TableShard`) holds rows with their optimizer state beside them (slot
tensors and per-row step counts indexed like the weight) and answers one server's calls for
them: ``id_bounds`` (validation), ``read`` and ``read_versioned`` (rows for ids),
``rows_still_pulled`` and ``apply`` (gradients of rows), ``snapshot`` and ``restore``
(checkpoints), ``nbytes`` and ``stats``. Two kinds answer it: :class:`FixedTable` here (a row
range, cyclic over servers) and ``DynamicTable`` in server/dynamic.py (any int64 id, with
admission and eviction).

What a read is for travels as one :class:`Reading` (training or not, the table's clock, the
pull it answers): a dynamic table admits, evicts and records by it; a fixed table's rows are
the same for every reading. A push names its pull for the same reason: a dynamic table applies
a gradient only to the row that pull handed out (server/dynamic.py says why).

Versions (kept when trainers cache rows, ``cache_lag`` set): each row counts the updates
applied to it, so a trainer's cached copy can be judged by how many updates it missed.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from paramserver import native
from paramserver.idmap import RESERVE_GROWTH
from paramserver.optim import (
    Empty,
    RowUpdate,
    State,
    UpdateRule,
    apply_updates,
    take_rows,
)
from paramserver.protocol import ROW_HELD, ROW_STEPS
from paramserver.sharding import ShardPlan, TableSpec
from paramserver.tableinit import RowInit

Pull = tuple[int, int]  # (trainer, call number) of a training read, as a push names it
HUGE_PAGE_BYTES = 2 << 20  # x86-64's and most arm64 kernels' transparent huge page
_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
# mmap's flag for address space charged to the system's commit only once touched: Python's
# mmap module does not name it, the compiled loops' module does (0: none).
_MAP_NORESERVE: int = getattr(native.loops, "MAP_NORESERVE", 0)


def _half_the_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (AttributeError, ValueError, OSError):  # a system that does not say: no more room
        return 0


# The address space a growing tensor (a dynamic table's rows, each of their state slots) is
# given room in: half the machine's memory, which Linux's default overcommit heuristic grants
# one mapping; untouched, it costs no memory.
GROWTH_ROOM_BYTES = _half_the_memory()


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


class TableShard(Protocol):
    """A server's rows of one embedding table, as the server's shard calls them.

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
        step (:func:`~paramserver.optim.apply_updates`) and :meth:`updated`."""
        ...

    def row_update(self, ids: Tensor, grads: Tensor, pull: Pull | None) -> RowUpdate:
        """The first part of :meth:`apply`: the rows ``grads`` go to (a dynamic table drops
        those whose row ``pull`` did not hand out), with the table's storage; changes nothing
        but counters. A server applies the updates of all its tables of one rule at once."""
        ...

    def updated(self, update: RowUpdate, clock: int) -> int:
        """The last part of :meth:`apply`, once ``update`` (from :meth:`row_update`) has been
        applied at step ``clock``: versions and touches; returns the rows updated."""
        ...

    def snapshot(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Copies of every row with its state, keyed by global row id or id (``"ids"``), and
        JSON-ready metadata (for checkpoints)."""
        ...

    def restore(self, saved: dict[str, Tensor], meta: dict[str, Any]) -> None:
        """Take this server's rows of ``saved`` and ``meta`` (from :meth:`snapshot`, of any
        shard layout); copies them."""
        ...

    def nbytes(self) -> int:
        """Bytes of every tensor the table holds."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters for the job summary (``rows``, ``memory_bytes``, and a kind's own)."""
        ...


class RowArena:
    """Storage that tables of one kind share on a server (one width, dtype and update rule):
    their rows with the rule's state slots and per-row bookkeeping, one tensor each, each table
    owning some of its rows. One request's rows of all of them are then read, gathered,
    updated and scattered in one call each, not one per table, which is most of a step's cost
    where tables are many and each touches a few hundred rows (Criteo's 26).

    ``steps`` (per-row update counts) where the rule reads them, ``last_touched`` where a
    dynamic table evicts, ``versions`` where trainers cache rows; None otherwise. Not
    thread-safe: a table's lock guards its rows, and growing (:meth:`grow`, dynamic tables
    only) runs under the lock their tables share.
    """

    def __init__(
        self,
        dim: int,
        dtype: torch.dtype,
        rule: UpdateRule,
        *,
        touched: bool = False,
        versions: bool = False,
        rows: int = 0,
        empty: Empty | None = None,
        max_rows: int | None = None,
    ):
        """``rows`` rows from ``empty`` (by default :func:`row_storage`): values
        uninitialised, state at the rule's start, counts at 0 (the owners set their rows);
        ``max_rows``: a bound on growth (dynamic tables' capacities), None for none."""
        empty = empty or row_storage
        self.rule = rule
        self.weight = empty((rows, dim), dtype)
        self.state: State = rule.init_state(self.weight, empty)
        self.steps = empty((rows,), torch.float32).zero_() if rule.needs_steps else None
        self.last_touched = empty((rows,), torch.int32).zero_() if touched else None
        self.versions = empty((rows,), torch.int64).zero_() if versions else None
        self.max_rows = max_rows

    @property
    def num_rows(self) -> int:
        return self.weight.shape[0]

    def grow(self, rows: int) -> None:
        """Hold ``rows`` rows (more than now), the new ones uninitialised (see
        :func:`regrown`)."""
        most = self.max_rows
        self.weight = regrown(self.weight, rows, most)
        self.state = {k: regrown(v, rows, most) for k, v in self.state.items()}
        if self.steps is not None:
            self.steps = regrown(self.steps, rows, most)
        if self.last_touched is not None:
            self.last_touched = regrown(self.last_touched, rows, most)
        if self.versions is not None:
            self.versions = regrown(self.versions, rows, most)

    def update(self, rows: Tensor, grads: Tensor) -> RowUpdate:
        """The update of ``rows`` (unique) with ``grads``."""
        return RowUpdate(self.weight, self.state, self.steps, rows, grads)

    def slice(self, start: int, end: int) -> tuple[Tensor, State, Tensor | None, Tensor | None]:
        """Views of rows ``start`` to ``end``: values, state, step counts, versions."""
        state = {k: v[start:end] for k, v in self.state.items()}
        return (
            self.weight[start:end],
            state,
            _rows_of(self.steps, start, end),
            _rows_of(self.versions, start, end),
        )

    def nbytes(self) -> int:
        return nbytes_of(
            self.weight, self.steps, self.last_touched, self.versions, *self.state.values()
        )

    def state_row_nbytes(self) -> int:
        """Bytes of one row's part of :meth:`state_of`."""
        steps = 4 if self.steps is not None else 0
        return sum(math.prod(v.shape[1:]) * v.element_size() for v in self.state.values()) + steps

    def state_of(self, rows: Tensor, held: Tensor | None = None) -> dict[str, Tensor]:
        """Copies of the optimizer state of ``rows`` (-1: no row, its state the rule's start),
        by part: each slot, :data:`ROW_STEPS` where the rule reads them and, where some row
        would not take the reader's pending update, :data:`ROW_HELD`: which would (``held``;
        by default those that exist)."""
        present = rows >= 0
        held = present if held is None else held
        parts = dict(self.state)
        if self.steps is not None:
            parts[ROW_STEPS] = self.steps
        if bool(present.all()):
            state = {part: v.index_select(0, rows) for part, v in parts.items()}
        else:
            state = {}
            for part, v in parts.items():
                start = 0.0 if part == ROW_STEPS else self.rule.initial_value
                state[part] = torch.full((rows.numel(), *v.shape[1:]), start, dtype=v.dtype)
                state[part][present] = v.index_select(0, rows[present])
        if not bool(held.all()):
            state[ROW_HELD] = held
        return state


def by_arena(tables: Mapping[str, TableShard], names: Iterable[str]) -> list[list[str]]:
    """``names`` grouped by the arena their tables share, each group in the given order: the
    tables whose rows one call reads, makes or updates together."""
    groups: dict[int, list[str]] = {}
    for name in names:
        groups.setdefault(id(tables[name].arena), []).append(name)
    return list(groups.values())


def _rows_of(tensor: Tensor | None, start: int, end: int) -> Tensor | None:
    return None if tensor is None else tensor[start:end]


class FixedTable:
    """The rows ``r`` of a table with ``r % num_servers == server``, at local index
    ``r // num_servers``; a :class:`TableShard`."""

    def __init__(
        self,
        spec: TableSpec,
        plan: ShardPlan,
        server: int,
        init: RowInit,
        rule: UpdateRule,
        cache_lag: int | None = None,
        place: tuple[RowArena, int] | None = None,
    ):
        """Makes this server's rows, and only those, from ``init``: in ``place`` (an arena
        shared with other tables and where this table's rows start in it; by default an arena
        of its own)."""
        self.spec = spec
        self.plan = plan
        self.server = server
        self.rule = rule
        self.id_bounds = (0, spec.num_rows - 1)
        ids = self.global_ids()
        if place is None:
            tracks = cache_lag is not None
            place = RowArena(spec.dim, spec.dtype, rule, versions=tracks, rows=ids.numel()), 0
        self.arena, self.base = place
        end = self.base + ids.numel()
        self.weight, self.state, self.steps, self.versions = self.arena.slice(self.base, end)
        init.fill(self.weight, ids)
        self.lock = threading.Lock()

    def _local(self, ids: Tensor) -> Tensor:
        """The local rows of ``ids`` (on one server, the ids themselves: read only)."""
        return ids if self.plan.num_servers == 1 else self.plan.local_rows(ids)

    def global_ids(self) -> Tensor:
        """The global ids of this server's rows, in local order."""
        return torch.arange(self.server, self.spec.num_rows, self.plan.num_servers)

    def read(self, ids: Tensor, reading: Reading) -> Tensor:
        """Copies of the rows of ``ids``; a fixed table's rows are there for every reading."""
        return take_rows(self.weight, self._local(ids).numpy())

    def apply(
        self, ids: Tensor, grads: Tensor, clock: int, pull: Pull | None = None, *, lr: float
    ) -> int:
        """Rows never move: every gradient applies to its row, whatever ``clock`` and
        ``pull``."""
        update = self.row_update(ids, grads, pull)
        apply_updates(self.rule, [update], lr)
        return self.updated(update, clock)

    def row_update(self, ids: Tensor, grads: Tensor, pull: Pull | None) -> RowUpdate:
        return self.arena.update(self.arena_rows(ids), grads)

    def arena_rows(self, ids: Tensor) -> Tensor:
        """The rows of ``ids`` in :attr:`arena` (read only)."""
        local = self._local(ids)
        return local + self.base if self.base else local

    def updated(self, update: RowUpdate, clock: int) -> int:
        if self.arena.versions is not None:
            self.arena.versions[update.rows] += 1
        return update.rows.numel()

    def read_versioned(self, ids: Tensor, reading: Reading) -> tuple[Tensor, Tensor]:
        """:meth:`read`, and each row's version."""
        assert self.versions is not None
        local = self._local(ids)
        return take_rows(self.weight, local.numpy()), self.versions.index_select(0, local)

    def rows_still_pulled(self, ids: Tensor, pull: Pull) -> Tensor | None:
        """Fixed rows never change owner: every gradient applies (None: keep all)."""
        return None

    def snapshot(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Copies of every row with its state, keyed by global row id (for checkpoints)."""
        return row_entries(
            self.global_ids(), self.weight, self.state, self.steps, self.versions
        ), {}

    def restore(self, saved: dict[str, Tensor], meta: dict[str, Any]) -> None:
        """Take the rows of ``saved`` (this server's, any shard layout it came from)."""
        local = self.plan.local_rows(saved["ids"])
        restore_rows(local, saved, self.weight, self.state, self.steps, self.versions)

    def nbytes(self) -> int:
        return nbytes_of(self.weight, self.steps, self.versions, *self.state.values())

    def stats(self) -> dict[str, int]:
        return {"rows": self.weight.shape[0], "memory_bytes": self.nbytes()}


def row_storage(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Uninitialised storage for a table's rows or their state, allocated whole (a fixed
    table's), owned by the caller.

    Requests read and write rows at random across whole tables (gigabytes): with 4 KiB pages
    nearly every row costs a TLB miss as well as a cache miss. So storage that spans a huge page
    is mapped on its own and marked for transparent huge pages (``madvise(MADV_HUGEPAGE)``,
    before anything touches it), which Linux honours in its ``madvise`` and ``always`` modes
    (``/sys/kernel/mm/transparent_hugepage/enabled``) where it has free huge pages, and falls
    back to small pages otherwise; elsewhere (other systems, small tensors) ``torch.empty``.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if _MADV_HUGEPAGE is None or nbytes < HUGE_PAGE_BYTES:
        return torch.empty(shape, dtype=dtype)
    memory = _mapped(nbytes)
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages: small ones
        memory.madvise(_MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=dtype).view(shape)  # keeps ``memory`` mapped


def _mapped(nbytes: int, *, reserved: bool = True) -> mmap.mmap:
    """``nbytes`` of anonymous memory mapped on their own: the system gives a page its memory
    (zeroed) when something first touches it, not before. Not ``reserved``: the pages are not
    charged to the system's commit until touched (``MAP_NORESERVE``), which room far beyond
    what is used needs: else a fork (a ``subprocess`` with ``preexec_fn``, a DataLoader's
    workers) is charged all of it, and refused."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if not reserved:
        flags |= _MAP_NORESERVE
    return mmap.mmap(-1, nbytes, flags=flags)


def regrown(tensor: Tensor, rows: int, most: int | None = None) -> Tensor:
    """``tensor`` (storage of its own, as this makes) with ``rows`` rows, its own first and
    the others uninitialised (their owner sets each before it is read), for storage that grows
    with its rows (a dynamic table's): extended in place where its storage has room, else
    copied into storage with room to grow in place (:func:`_room`; at most ``most`` rows
    where the rows are bounded), so copies are rare as a table grows: a copy stalls the
    server (a table of gigabytes, seconds) and holds the storage twice meanwhile.

    Not on huge pages: rows are created a few hundred at a time, and a huge page faulted in
    as they reach it (zeroed whole, memory compacted for it) cost more than its fewer TLB
    misses saved (the core model's dynamic tables: filling 5.3-5.5 ms a step with small pages
    against 7.3-7.9 with huge ones, and no faster once filled)."""
    shape = (rows, *tensor.shape[1:])
    storage = tensor.untyped_storage()
    fits = math.prod(shape) * tensor.element_size() <= storage.nbytes()
    if fits and tensor.storage_offset() == 0 and tensor.is_contiguous():
        whole = torch.empty(0, dtype=tensor.dtype).set_(storage)
        return whole[: math.prod(shape)].view(shape)
    grown = _room(shape, tensor.dtype, most)[:rows]
    grown[: tensor.shape[0]] = tensor
    return grown


def _room(shape: tuple[int, ...], dtype: torch.dtype, most: int | None) -> Tensor:
    """Uninitialised storage for ``shape[0]`` rows and room for more: as many as fit in
    :data:`GROWTH_ROOM_BYTES` (at least :data:`RESERVE_GROWTH` times the rows), but no more
    than ``most``, mapped on their own and unreserved (:func:`_mapped`), so rows not yet
    reached cost no memory. Where the system refuses that much address space (strict
    overcommit, a limit on it) or cannot leave it unreserved (no ``MAP_NORESERVE`` without
    the compiled loops): :data:`RESERVE_GROWTH` times the rows, else the rows alone."""
    rows, row_bytes = shape[0], math.prod(shape[1:]) * dtype.itemsize
    reserve = rows * RESERVE_GROWTH
    wide = max(GROWTH_ROOM_BYTES // row_bytes, reserve) if _MAP_NORESERVE else reserve
    for room, reserved in ((wide, False), (reserve, True)):
        room = room if most is None else min(room, most)
        if room > rows:
            with contextlib.suppress(OSError):
                memory = _mapped(room * row_bytes, reserved=reserved)
                return torch.frombuffer(memory, dtype=dtype).view(room, *shape[1:])
    return torch.empty(shape, dtype=dtype)


def nbytes_of(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def row_entries(
    ids: Tensor,
    weight: Tensor,
    state: State,
    steps: Tensor | None,
    versions: Tensor | None,
    rows: Tensor | None = None,
    last_touched: Tensor | None = None,
) -> dict[str, Tensor]:
    """Copies of the given rows (all if ``rows`` is None) of each per-row tensor, by name."""

    def take(tensor: Tensor) -> Tensor:
        return tensor.clone() if rows is None else tensor.index_select(0, rows)

    entries = {"ids": ids, "value": take(weight)}
    entries.update({f"state.{k}": take(v) for k, v in state.items()})
    for name, tensor in (("steps", steps), ("versions", versions), ("last_touched", last_touched)):
        if tensor is not None:
            entries[name] = take(tensor)
    return entries


def restore_rows(
    rows: Tensor,
    saved: dict[str, Tensor],
    weight: Tensor,
    state: State,
    steps: Tensor | None,
    versions: Tensor | None,
) -> None:
    """Put a snapshot's entries ``saved`` (:func:`row_entries`) at ``rows``: values, state
    slots, step counts and versions (0 where the snapshot has none)."""
    weight[rows] = saved["value"]
    for slot, value in state.items():
        value[rows] = saved[f"state.{slot}"]
    if steps is not None:
        steps[rows] = saved["steps"]
    if versions is not None:
        versions[rows] = saved.get("versions", 0)
