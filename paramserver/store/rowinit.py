"""The rows of a server's dynamic tables, found and made for all of them at once.

A request names dozens of tables (Criteo's 26), each touching a few hundred rows: work done
once per table would be most of its cost. So the tables of one kind (width, dtype, update
rule) share one arena (:func:`dynamic_arena`), all tables share one id map
(:class:`~paramserver.idmap.FusedIdMap`), and a read finds every table's ids in one search
(:func:`locate_together`), admits and makes their new rows in one pass, initial values from
:func:`init_rows`, and takes their values in one call per arena (:func:`values_together`).
What a table decides alone (admission counts, eviction, pull records) is
:class:`~paramserver.server.dynamic.DynamicTable`'s.
"""

from __future__ import annotations

import functools
import itertools
import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from paramserver import native
from paramserver.hashing import mix64_array
from paramserver.idmap import Found, FusedIdMap
from paramserver.optim import UpdateRule, loops_take, put_rows, take_rows
from paramserver.server.tables import Reading, RowArena, by_arena
from paramserver.sharding import DynamicOptions, TableSpec

if TYPE_CHECKING:  # the tables these functions serve call them: a type only
    from paramserver.server.dynamic import DynamicTable


def init_rows(table: str, options: DynamicOptions, ids: Tensor, dim: int) -> Tensor:
    """The initial rows of ``ids``: uniform in ``[-init_scale, init_scale)``, a pure function
    of (table name, seed, id, column).

    Each id gets a well-mixed 64-bit seed; column ``j`` takes the top 24 bits of that seed
    times an odd constant of its own (one multiply per value, not a full hash). Computed with
    numpy: a step creates a few hundred rows per table, where numpy's per-call cost is lower.
    """
    salts = np.array([_salt(table, options)], dtype=np.int64)
    scales = np.array([options.init_scale], dtype=np.float32)
    return _uniform_rows(salts, ids.numpy(), dim, scales)


def _salt(table: str, options: DynamicOptions) -> int:
    return zlib.crc32(table.encode()) * 0x10001 + options.seed * 0x9E3779B1


def _uniform_rows(salts: np.ndarray, ids: np.ndarray, dim: int, scales: np.ndarray) -> Tensor:
    """:func:`init_rows` of ``ids``, each with its table's salt and scale (or one of each for
    all)."""
    seeds = mix64_array(ids.astype(np.int64) + salts)
    bits = (seeds[:, None] * _column_multipliers(dim)).view(np.uint64)
    bits >>= np.uint64(40)  # in place from here: fewer passes over fresh memory
    unit = bits.astype(np.float32)  # exact: under 2^24
    scales = np.asarray(scales, dtype=np.float32).reshape(-1, 1)
    # (bits / 2^24) * 2s in one multiply: scaling by 2^-24 is exact, so the product rounds
    # the same real number once, either way.
    unit *= 2 * scales * np.float32(1.0 / (1 << 24))
    unit -= scales
    return torch.from_numpy(unit)


@functools.cache
def _column_multipliers(dim: int) -> np.ndarray:
    return mix64_array(np.arange(dim, dtype=np.int64)) | 1


def _init_values_and_state(
    arena: RowArena, rows: np.ndarray, ids: np.ndarray, salts: np.ndarray, scales: np.ndarray
) -> None:
    """Set ``arena``'s new ``rows``: values as :func:`_uniform_rows` makes them, state at the
    rule's start. By the compiled loop where the arena is float32 (each row written once),
    else by numpy and torch."""
    dim, initial = arena.weight.shape[1], arena.rule.initial_value
    if loops_take(arena.weight, *arena.state.values()):
        assert native.loops is not None
        native.loops.init_rows(
            arena.weight.numpy(), dim, np.ascontiguousarray(rows), np.ascontiguousarray(ids),
            salts, scales.astype(np.float32), _column_multipliers(dim),
            tuple(slot.numpy() for slot in arena.state.values()), initial,
        )  # fmt: skip
        return
    values = _uniform_rows(salts, ids, dim, scales)
    put_rows(arena.weight, rows, values.to(arena.weight.dtype))
    for slot in arena.state.values():
        slot.index_fill_(0, torch.from_numpy(rows), initial)


def dynamic_arena(specs: Sequence[TableSpec], rule: UpdateRule, cache_lag: int | None) -> RowArena:
    """Empty, growing row storage for the dynamic tables ``specs`` (of one kind: width, dtype,
    ``rule``; see :func:`~paramserver.server.tables.regrown`), growing no further than their
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


def locate_together(
    tables: Mapping[str, DynamicTable],
    wanted: Mapping[str, Tensor],
    shared: FusedIdMap,
    reading: Reading,
) -> dict[str, Tensor]:
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
    return {n: tables[n].settle(wanted[n], each[i], reading) for i, n in enumerate(names)}


def values_together(
    tables: Mapping[str, DynamicTable], located: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """The values of each table's ``located`` rows, the default vector where a row is -1;
    those of tables sharing an arena taken in one call (the tensors are then views of one)."""
    values: dict[str, Tensor] = {}
    for names in by_arena(tables, located):
        rows = torch.cat([located[name] for name in names])
        counts = [located[name].numel() for name in names]
        weight = tables[names[0]].arena.weight
        present = rows >= 0
        if bool(present.all()):
            together = take_rows(weight, rows.numpy())
        else:  # the default vectors where an id has no row
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
                seen = table.count_sightings(wanted[name][torch.from_numpy(seen_at)], clock)
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
        group_ids = np.concatenate([ids[start:end] for start, end in spans])
        group_rows = np.concatenate([rows[start:end] for start, end in spans])
        salts = np.repeat([_salt(name, tables[name].options) for name in names], counts)
        scales = np.repeat([tables[name].options.init_scale for name in names], counts)
        _init_values_and_state(arena, group_rows, group_ids, salts.astype(np.int64), scales)
        if arena.steps is not None:
            arena.steps.index_fill_(0, torch.from_numpy(group_rows), 0)
        if arena.versions is not None:
            fresh = np.repeat([tables[name].fresh_version for name in names], counts)
            arena.versions[torch.from_numpy(group_rows)] = torch.from_numpy(fresh)
        for name, count in zip(names, counts, strict=True):
            tables[name].counters.admitted += count
