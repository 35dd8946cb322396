"""A rule's updates applied to rows of tables (a server's, or a prefetching trainer's own):
where the rule has a compiled loop, stepped in place; otherwise the rows and their state
gathered in blocks of one step-count group each (:meth:`UpdateRule.step_group`), stepped by
the rule (:meth:`UpdateRule.step_blocks`) and put back. :func:`take_rows` and
:func:`put_rows` move rows as whole items, the cheapest way on CPU."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from paramserver.optim import Block, RowUpdate, State, UpdateRule


def apply_rows(
    rule: UpdateRule,
    weight: Tensor,
    state: State,
    steps: Tensor | None,
    rows: Tensor,
    grads: Tensor,
    lr: float,
) -> None:
    """Apply ``grads`` to ``weight[rows]`` (``rows`` unique) at learning rate ``lr``, and the
    rows' state and step counts (``steps`` is None for a rule whose math ignores them).

    :func:`apply_updates` of this one table. Not thread-safe: the caller holds the table's lock.
    """
    apply_updates(rule, [RowUpdate(weight, state, steps, rows, grads)], lr)


def apply_updates(rule: UpdateRule, updates: Sequence[RowUpdate], lr: float) -> None:
    """Apply each update, all by ``rule`` at learning rate ``lr`` (tables of one rule).

    Where the rule has a compiled loop, it steps the rows in place
    (:meth:`UpdateRule.step_rows_in_place`). Otherwise, gathers each table's rows and their
    state, groups them by step count (see :meth:`UpdateRule.step_group`), runs the rule once
    over every group of every table (:meth:`UpdateRule.step_blocks`: one torch.optim call
    where the rule allows it) and scatters the rows back. Either way, the same result as one
    table at a time. Not thread-safe: the caller holds the tables' locks.
    """
    by_storage: dict[int, list[RowUpdate]] = {}
    for update in updates:
        if update.rows.numel():
            by_storage.setdefault(id(update.weight), []).append(update)
    left = [parts for parts in by_storage.values() if not rule.step_rows_in_place(parts, lr)]
    gathered = [_gather(rule, _merged(parts)) for parts in left]
    rule.step_blocks([block for each in gathered for block in each.blocks], lr)
    for each in gathered:
        each.scatter()


def _merged(parts: list[RowUpdate]) -> RowUpdate:
    """``parts`` (updates of disjoint rows in one storage: tables sharing a
    :class:`~paramserver.store.arena.RowArena`) made one, so their rows are gathered,
    stepped and scattered in one call each (joining their gradients costs less than the
    rule's per-tensor work: Criteo's 26 tables step ~2.5x faster as one)."""
    if len(parts) == 1:
        return parts[0]
    return dataclasses.replace(
        parts[0],
        rows=torch.cat([part.rows for part in parts]),
        grads=torch.cat([part.grads for part in parts]),
    )


@dataclass
class _Gathered:
    """An update's rows gathered for the rule (``values``, ``state``: copies, in the order of
    ``rows``), in blocks of one step-count group each."""

    update: RowUpdate
    rows: Tensor
    values: Tensor
    state: State
    blocks: list[Block]

    def scatter(self) -> None:
        """Write the updated rows and state back, and count their steps."""
        target = self.update
        rows = self.rows.numpy()
        put_rows(target.weight, rows, self.values)
        for slot, value in self.state.items():
            put_rows(target.state[slot], rows, value)
        if target.steps is not None:
            target.steps.index_add_(0, self.rows, torch.ones(self.rows.numel()))


def put_rows(target: Tensor, rows: np.ndarray, values: Tensor) -> None:
    """``target[rows] = values`` (``rows`` unique), row by row as numpy items (one copy of a
    row's bytes each: about a third of the time of numpy's or torch's indexing of 2-D rows on
    CPU), where both are contiguous."""
    if target.is_contiguous() and values.is_contiguous() and target.dim() == 2:
        array = _numpy_of(target)
        row = _row_dtype(array.shape[1] * array.itemsize)
        array.view(row)[rows] = _numpy_of(values).view(row)
    else:
        target.index_copy_(0, torch.from_numpy(rows), values)


def take_rows(source: Tensor, rows: np.ndarray) -> Tensor:
    """``source[rows]`` (a new tensor), taken as :func:`put_rows` writes them."""
    if not (source.is_contiguous() and source.dim() == 2):
        return source.index_select(0, torch.from_numpy(rows))
    array = _numpy_of(source)
    row = _row_dtype(array.shape[1] * array.itemsize)
    taken = torch.from_numpy(np.take(array.view(row), rows, axis=0).view(array.dtype))
    return taken if taken.dtype == source.dtype else taken.view(source.dtype)


def _numpy_of(tensor: Tensor) -> np.ndarray:
    """``tensor`` as a numpy view: of its bytes where numpy lacks its dtype (bfloat16)."""
    try:
        return tensor.numpy()
    except TypeError:
        return tensor.view(torch.uint8).numpy()


@functools.cache
def _row_dtype(nbytes: int) -> np.dtype:
    """An opaque numpy item of a row's ``nbytes``: a row copied as one item."""
    return np.dtype((np.void, nbytes))


def _gather(rule: UpdateRule, update: RowUpdate) -> _Gathered:
    """``update``'s rows and state gathered, in blocks: one per step-count group (rows ordered
    by it), or one for all where the rule ignores step counts."""
    rows, steps, grads = update.rows, update.steps, [update.grads]
    row_steps = None if steps is None else steps.index_select(0, rows)
    keys = None if row_steps is None else rule.step_group(row_steps)
    sizes = [rows.numel()]
    if keys is not None:
        assert row_steps is not None
        order = torch.argsort(keys, stable=True)
        rows, row_steps = rows[order], row_steps[order]
        sizes = torch.unique_consecutive(keys[order], return_counts=True)[1].tolist()
        grads = list(update.grads[order].split(sizes))
    at = rows.numpy()
    values = take_rows(update.weight, at)
    state = {slot: take_rows(value, at) for slot, value in update.state.items()}
    starts = itertools.accumulate(sizes, initial=0)
    blocks = [
        Block(
            values[start : start + size],
            grad,
            {slot: value[start : start + size] for slot, value in state.items()},
            _block_step(row_steps, start),
        )
        for start, size, grad in zip(starts, sizes, grads, strict=False)
    ]
    return _Gathered(update, rows, values, state, blocks)


def _block_step(row_steps: Tensor | None, start: int) -> Tensor:
    """A block's step count: its first row's (all rows of a block share the part that
    matters); 0 where the rule ignores it."""
    if row_steps is None:
        return torch.zeros((), dtype=torch.float32)
    return row_steps[start].clone()
