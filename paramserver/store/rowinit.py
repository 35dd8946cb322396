"""A dynamic table's initial rows: a pure function of the table's name, its seed and the id,
so a row does not depend on the server that makes it or on when its id first arrived."""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from paramserver import native
from paramserver.embedding import DynamicOptions
from paramserver.hashing import mix64_array
from paramserver.native import Recipe
from paramserver.rowupdates import put_rows
from paramserver.store.arena import RowArena


def init_rows(table: str, options: DynamicOptions, ids: Tensor, dim: int) -> Tensor:
    """The initial rows of ``ids``: uniform in ``[-init_scale, init_scale)``, a pure function
    of (table name, seed, id, column).

    Each id gets a well-mixed 64-bit seed; column ``j`` takes the top 24 bits of that seed
    times an odd constant of its own (one multiply per value, not a full hash). Computed with
    numpy: a step creates a few hundred rows per table, where numpy's per-call cost is lower.
    """
    salts = np.array([salt(table, options)], dtype=np.int64)
    scales = np.array([options.init_scale], dtype=np.float32)
    return _uniform_rows(salts, ids.numpy(), column_multipliers(dim), scales)


def salt(table: str, options: DynamicOptions) -> int:
    return zlib.crc32(table.encode()) * 0x10001 + options.seed * 0x9E3779B1


def _uniform_rows(
    salts: np.ndarray, ids: np.ndarray, multipliers: np.ndarray, scales: np.ndarray
) -> Tensor:
    """:func:`init_rows` of ``ids``, each with its table's salt and scale (or one of each for
    all), a column for each of :func:`column_multipliers`."""
    seeds = mix64_array(ids.astype(np.int64) + salts)
    bits = (seeds[:, None] * multipliers).view(np.uint64)
    bits >>= np.uint64(40)  # in place from here: fewer passes over fresh memory
    unit = bits.astype(np.float32)  # exact: under 2^24
    scales = np.asarray(scales, dtype=np.float32).reshape(-1, 1)
    # (bits / 2^24) * 2s in one multiply: scaling by 2^-24 is exact, so the product rounds
    # the same real number once, either way.
    unit *= 2 * scales * np.float32(1.0 / (1 << 24))
    unit -= scales
    return torch.from_numpy(unit)


@functools.cache
def column_multipliers(dim: int) -> np.ndarray:
    return mix64_array(np.arange(dim, dtype=np.int64)) | 1


def init_values_and_state(
    arena: RowArena, rows: np.ndarray, ids: np.ndarray, salts: np.ndarray, scales: np.ndarray
) -> None:
    """Set ``arena``'s new ``rows``: values as :func:`_uniform_rows` makes them, state at the
    rule's start. By the compiled loop where the arena is float32 (each row written once),
    else by :func:`_init_by_numpy`."""
    recipe = (ids, salts, scales, column_multipliers(arena.weight.shape[1]))
    state = tuple(arena.state.values())
    native.init_rows(arena.weight, state, arena.rule.initial_value, rows, recipe, _init_by_numpy)


def _init_by_numpy(
    weight: Tensor, state: Sequence[Tensor], initial: float, rows: np.ndarray, recipe: Recipe
) -> None:
    """:func:`init_values_and_state` by numpy and torch: a pass per array."""
    ids, salts, scales, multipliers = recipe
    values = _uniform_rows(salts, ids, multipliers, scales)
    put_rows(weight, rows, values.to(weight.dtype))
    for slot in state:
        slot.index_fill_(0, torch.from_numpy(rows), initial)
