"""Row storage that tables of one kind share on a server, the update of some of its rows, and
copies of rows for checkpoints."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from paramserver.optim import Empty, RowUpdate, State, UpdateRule
from paramserver.store.growth import regrown, row_storage

# The parts of a row's optimizer state besides its rule's slots: its count of updates (where
# the rule reads it) and, where some would not, which rows take the update the trainer has
# pending (computed from its previous call's read): a dynamic table's rows that exist and
# are the rows that read handed out.
ROW_STEPS, ROW_HELD = "steps", "held"


@dataclass
class TableUpdate(RowUpdate):
    """One table's part of an update (:meth:`RowArena.update`): the rule's step on its rows
    in the arena, and the table's ids of those rows (those that take it), which the change
    feed is told once it is applied."""

    ids: Tensor


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

    def update(self, rows: Tensor, grads: Tensor, ids: Tensor) -> TableUpdate:
        """The update of ``rows`` (unique; those of a table's ``ids``) with ``grads``."""
        return TableUpdate(self.weight, self.state, self.steps, rows, grads, ids)

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
        parts = dict(self.state)
        if self.steps is not None:
            parts[ROW_STEPS] = self.steps
        # numpy checks the rows in a fraction of torch's time per call (one call per table)
        if not rows.numel() or int(rows.numpy().min()) >= 0:
            state = {part: v.index_select(0, rows) for part, v in parts.items()}
        else:
            present = rows >= 0
            held = present if held is None else held
            state = {}
            for part, v in parts.items():
                start = 0.0 if part == ROW_STEPS else self.rule.initial_value
                state[part] = torch.full((rows.numel(), *v.shape[1:]), start, dtype=v.dtype)
                state[part][present] = v.index_select(0, rows[present])
        if held is not None and not held.numpy().all():
            state[ROW_HELD] = held
        return state


class InArena(Protocol):
    """A table whose rows live in an arena (every kind of table)."""

    @property
    def arena(self) -> RowArena: ...


def by_arena(tables: Mapping[str, InArena], names: Iterable[str]) -> list[list[str]]:
    """``names`` grouped by the arena their tables share, each group in the given order: the
    tables whose rows one call reads, makes or updates together."""
    groups: dict[int, list[str]] = {}
    for name in names:
        groups.setdefault(id(tables[name].arena), []).append(name)
    return list(groups.values())


def _rows_of(tensor: Tensor | None, start: int, end: int) -> Tensor | None:
    return None if tensor is None else tensor[start:end]


def nbytes_of(*tensors: Tensor | None) -> int:
    return sum(t.nbytes for t in tensors if t is not None)


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
    saved: Mapping[str, Tensor],
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
