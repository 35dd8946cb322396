"""A fixed table: a server's rows of an embedding table of known size, cyclic over servers;
and a store's fixed tables read together (:class:`FixedTables`)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from paramserver.errors import StoreError
from paramserver.optim import Empty, UpdateRule
from paramserver.rowupdates import apply_updates, take_rows
from paramserver.sharding import ShardPlan, TableSpec
from paramserver.store.arena import RowArena, by_arena, nbytes_of, restore_rows, row_entries
from paramserver.store.changes import ChangeFeed
from paramserver.store.table import (
    Pull,
    ReadAsks,
    Reading,
    RowsRead,
    StateRead,
    TableUpdate,
    holding,
)
from paramserver.tableinit import RowInit


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
        changes: ChangeFeed | None = None,
    ):
        """Makes this server's rows, and only those, from ``init``: in ``place`` (an arena
        shared with other tables and where this table's rows start in it; by default an arena
        of its own). ``changes``: the feed its changes are told to (by default one of its
        own)."""
        self.spec = spec
        self.changes = changes or ChangeFeed()
        self.plan = plan
        self.server = server
        self.rule = rule
        self.id_bounds = (0, spec.num_rows - 1)
        ids = self.held_ids()
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

    def held_ids(self) -> Tensor:
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
        self.changes.rows_written({self.spec.name: ids})
        return self.updated(update, clock)

    def row_update(self, ids: Tensor, grads: Tensor, pull: Pull | None) -> TableUpdate:
        return self.arena.update(self.arena_rows(ids), grads, ids)

    def arena_rows(self, ids: Tensor) -> Tensor:
        """The rows of ``ids`` in :attr:`arena` (read only)."""
        local = self._local(ids)
        return local + self.base if self.base else local

    def updated(self, update: TableUpdate, clock: int) -> int:
        if self.arena.versions is not None:
            self.arena.versions[update.rows] += 1
        return update.ids.numel()

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
        return row_entries(self.held_ids(), self.weight, self.state, self.steps, self.versions), {}

    def restore(self, saved: dict[str, Tensor], meta: dict[str, Any]) -> None:
        """Take the rows of ``saved`` (this server's, any shard layout it came from)."""
        self.set_rows(saved)

    def snapshot_of(
        self, ids: Tensor, pending: Tensor | None
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """:meth:`snapshot` of the rows of ``ids`` (sorted, unique, this server's); a fixed
        table has no pending ids."""
        local = self._local(ids)
        entries = row_entries(ids, self.weight, self.state, self.steps, self.versions, local)
        return entries, {}

    def replay(self, saved: dict[str, Tensor], meta: dict[str, Any]) -> None:
        """Set the rows of ``saved`` (:meth:`snapshot_of`'s)."""
        self.set_rows(saved)

    def set_rows(self, entries: Mapping[str, Tensor]) -> None:
        ids = entries["ids"]
        if ids.numel() and (
            int(ids.min()) < 0
            or int(ids.max()) >= self.spec.num_rows
            or bool((self.plan.server_of_rows(self.spec.name, ids) != self.server).any())
        ):
            raise StoreError(
                f"table {self.spec.name!r}: rows set on server {self.server} must be its own "
                f"rows of 0..{self.spec.num_rows - 1}"
            )
        local = self.plan.local_rows(ids)
        restore_rows(local, entries, self.weight, self.state, self.steps, self.versions)
        if ids.numel():
            self.changes.rows_written({self.spec.name: ids})

    def delete_ids(self, ids: Tensor) -> None:
        raise StoreError(
            f"table {self.spec.name!r} is a fixed table: its rows cannot be deleted (only a "
            f"DynamicEmbedding's can)"
        )

    def nbytes(self) -> int:
        return nbytes_of(self.weight, self.steps, self.versions, *self.state.values())

    def stats(self) -> dict[str, int]:
        return {"rows": self.weight.shape[0], "memory_bytes": self.nbytes()}


class FixedTables:
    """A store's fixed tables, read together: a :class:`~paramserver.store.table.TableGroup`.

    Rows of tables sharing an arena are taken in one call under their locks; those of tables
    whose versions are asked (trainers cache them) one table at a time, with the versions."""

    def __init__(self, tables: Mapping[str, FixedTable]):
        self.tables = dict(tables)
        self.names = frozenset(tables)

    def read(
        self, wanted: Mapping[str, Tensor], reading: Reading, asks: ReadAsks, into: RowsRead
    ) -> None:
        if not asks.versioned:
            self._read_plain(wanted, asks.state_masks, into)
            return
        versioned = {n: ids for n, ids in wanted.items() if n in asks.versioned}
        for name, ids in versioned.items():
            table = self.tables[name]
            with table.lock:
                into.values[name], into.versions[name] = table.read_versioned(ids, reading)
                if name in asks.state_masks:
                    asked = table.arena_rows(ids[asks.state_masks[name]])
                    state = table.arena.state_of(asked)
                    into.state.append(StateRead([name], [asked.numel()], state))
        plain = {n: ids for n, ids in wanted.items() if n not in versioned}
        self._read_plain(plain, asks.state_masks, into)

    def _read_plain(
        self, wanted: Mapping[str, Tensor], state_masks: Mapping[str, Tensor], into: RowsRead
    ) -> None:
        """The rows of ``wanted``, those of tables sharing an arena taken in one call under
        their locks (the tensors are then views of one), with the state of the rows
        ``state_masks`` pick."""
        for names in by_arena(self.tables, wanted):
            tables = [self.tables[name] for name in names]
            arena_rows = [t.arena_rows(wanted[n]) for t, n in zip(tables, names, strict=True)]
            rows = torch.cat(arena_rows)
            picked = zip(names, arena_rows, strict=True)
            asked = [(n, rows_of[state_masks[n]]) for n, rows_of in picked if n in state_masks]
            with holding([table.lock for table in tables]):
                together = take_rows(tables[0].arena.weight, rows.numpy())
                if asked:  # every table's asked rows in one call
                    state = tables[0].arena.state_of(torch.cat([r for _, r in asked]))
                    counts = [r.numel() for _, r in asked]
                    into.state.append(StateRead([n for n, _ in asked], counts, state))
            counts = [wanted[name].numel() for name in names]
            into.values.update(zip(names, together.split_with_sizes(counts), strict=True))


def fixed_tables(
    specs: Mapping[str, TableSpec],
    plan: ShardPlan,
    server: int,
    inits: Mapping[str, RowInit],
    rules: Mapping[str, UpdateRule],
    cache_lag: int | None,
    changes: ChangeFeed,
    storage: Empty | None = None,
) -> dict[str, FixedTable]:
    """This server's shards of the fixed tables ``specs`` of one kind (width, dtype, update
    rule), their rows in one arena (allocated by ``storage``) one table after another, made
    from ``inits``."""
    first = next(iter(specs))
    sizes = [len(range(server, spec.num_rows, plan.num_servers)) for spec in specs.values()]
    dim, dtype, rule = specs[first].dim, specs[first].dtype, rules[first]
    tracks = cache_lag is not None
    arena = RowArena(dim, dtype, rule, versions=tracks, rows=sum(sizes), empty=storage)
    tables: dict[str, FixedTable] = {}
    start = 0
    for (name, spec), size in zip(specs.items(), sizes, strict=True):
        tables[name] = FixedTable(
            spec, plan, server, inits[name], rules[name], cache_lag, (arena, start), changes
        )
        start += size
    return tables
