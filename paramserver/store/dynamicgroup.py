"""A server's dynamic tables read together (a :class:`~paramserver.store.table.TableGroup`):
they share one id map, so a read of all of them costs one search and one insert
(:func:`~paramserver.store.dynamic.locate_together`), and one lock; the tables of one kind
(width, dtype, update rule) share one arena, so their rows, and the state of those a
prefetch asks, are taken in one gather each."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from paramserver.optim import UpdateRule
from paramserver.sharding import TableSpec
from paramserver.store.arena import by_arena
from paramserver.store.changes import ChangeFeed
from paramserver.store.dynamic import (
    DynamicTable,
    Located,
    SharedRows,
    dynamic_arena,
    locate_together,
    values_together,
)
from paramserver.store.idmap import FusedIdMap
from paramserver.store.table import ReadAsks, Reading, RowsRead, StateRead


class DynamicTables:
    """A store's dynamic tables, read together: a :class:`~paramserver.store.table.TableGroup`.
    They share one id map (so a read of all of them costs one search and one insert,
    :func:`locate_together`) and so one lock."""

    def __init__(
        self, tables: Mapping[str, DynamicTable], id_map: FusedIdMap, lock: threading.Lock
    ):
        self.tables = dict(tables)
        self.names = frozenset(tables)
        self.id_map = id_map
        self.lock = lock

    def read(
        self, wanted: Mapping[str, Tensor], reading: Reading, asks: ReadAsks, into: RowsRead
    ) -> None:
        """The rows of ``wanted``, all found (and made) together; the state of those the masks
        pick, with which of them take the reader's ``asks.pending`` push."""
        with self.lock:
            located = locate_together(self.tables, wanted, self.id_map, reading)
            values = values_together(self.tables, located, joined=located.joined)
            for name, found in located.items():
                into.values[name] = values[name]
                if name in asks.versioned:
                    into.versions[name] = self.tables[name].versions_of(found)
            asked = {name: found for name, found in located.items() if name in asks.state_masks}
            for names in by_arena(self.tables, asked):
                into.state.append(self._state_read(names, wanted, located, asks))

    def _state_read(
        self, names: list[str], wanted: Mapping[str, Tensor], located: Located, asks: ReadAsks
    ) -> StateRead:
        """The state of the rows the masks of ``names`` (tables sharing an arena) pick, every
        table's in one gather; which take the pending push found table by table (each keeps
        its own reads' records)."""
        masks = [asks.state_masks[name].numpy() for name in names]
        # numpy finds the picked places in a fraction of a torch mask's time
        picked = torch.from_numpy(np.flatnonzero(np.concatenate(masks)))
        rows = located.joined if located.joined is not None and list(located) == names else None
        if rows is None:
            rows = torch.cat([located[name] for name in names])
        at = rows.index_select(0, picked)
        counts = [int(np.count_nonzero(mask)) for mask in masks]
        arena = self.tables[names[0]].arena
        pending = asks.pending
        if pending is None:
            return StateRead(names, counts, arena.state_of(at))
        held = at >= 0
        kept = [self.tables[name].pulls.all_rows_kept(pending) for name in names]
        if not all(kept):  # some table's read handed out rows it has lost since
            ids = torch.cat([wanted[name] for name in names]).index_select(0, picked)
            starts = itertools.accumulate(counts, initial=0)
            for name, start, count, whole in zip(names, starts, counts, kept, strict=False):
                if not whole:
                    part = slice(start, start + count)
                    held[part] = self.tables[name].rows_taking_update(ids[part], at[part], pending)
        return StateRead(names, counts, arena.state_of(at, held))


def dynamic_tables(
    specs: Sequence[Sequence[TableSpec]],
    rules: Mapping[str, UpdateRule],
    cache_lag: int | None,
    changes: ChangeFeed,
) -> DynamicTables:
    """A server's dynamic tables, each of ``specs`` a kind (width, dtype, update rule) whose
    rows share one arena, all sharing one id map (a row group per kind) and one lock."""
    groups = [kind for kind, names in enumerate(specs) for _ in names]
    id_map = FusedIdMap(len(groups), groups=groups)
    spaces = itertools.count()  # each table's space in the id map, in group order
    lock = threading.Lock()
    tables = {}
    for kind in specs:
        arena = dynamic_arena(kind, rules[kind[0].name], cache_lag)
        for spec in kind:
            shared = SharedRows(id_map.table(next(spaces)), lock, arena, changes)
            tables[spec.name] = DynamicTable(spec, rules[spec.name], cache_lag, shared)
    return DynamicTables(tables, id_map, lock)
