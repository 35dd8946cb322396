"""A trainer's own latest update, applied to the values it prefetched.

Prefetching, the call that pulls step ``t``'s values leaves while step ``t - 1`` computes, so
the servers answer it without step ``t - 1``'s gradients (they ride on the next call). Rows
both steps touch, and the dense values, would then reach step ``t`` one update of this
trainer's own behind, which costs held-out quality wherever consecutive batches share rows
(MovieLens's users, a history's items). So the servers send the optimizer state of those rows
and of the dense values with them (``PushPullRequest.pull_state``, ``pull_dense_state``; none
for plain SGD, whose update reads none), and the trainer applies its pending gradients to
them by the same rules (:mod:`paramserver.optim`: the code the servers run), at the learning
rate the servers will (the schedule at the gradients' step).

With one trainer and no lossy gradient codec, step ``t`` then sees bitwise the values it
would have pulled without prefetch. With several trainers it misses only the others' updates
since the read, as any async read may. Where a codec compresses the pushed gradients, the
trainer applies them uncompressed (the servers apply them decoded): the values differ by the
codec's rounding until the next pull. Server-pooled tables stay a step behind (their rows
never reach the trainer), and so do dense parameters kept by all-reduce (a step's mean is
applied the step after next, see :mod:`paramserver.trainer.dense`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from paramserver import native
from paramserver.config import OptimSection
from paramserver.optim import Block, PulledRows, PulledTable, UpdateRule, make_rule
from paramserver.rowupdates import apply_rows
from paramserver.store.arena import ROW_STEPS
from paramserver.trainer.client import Pulled
from paramserver.trainer.gradmode import without_grad
from paramserver.trainer.rowstate import RowState, RowStates, StateMasks


class OwnUpdates:
    """The update rules of the dense parameters and of each table, to step prefetched values
    as the servers will.

    ``known``: the tables whose rows' state the trainer knows without asking: fixed tables
    (every row a read handed out takes the update) of a rule that reads no state (plain SGD).
    Their rows that take the pending update are those the pending gradients touch, found
    here; the servers are asked for none of them (:meth:`to_ask`)."""

    def __init__(
        self,
        dense_rule: UpdateRule,
        table_rules: Mapping[str, UpdateRule],
        known: frozenset[str] = frozenset(),
    ):
        self.dense_rule = dense_rule
        self.table_rules = dict(table_rules)
        self.known = known
        # Tables whose rules are alike (one type and config) step together: numbered once,
        # not found by hashing each table's config every step.
        alike: dict[tuple[object, ...], int] = {}
        self._alike = {
            name: alike.setdefault((type(rule), rule.config), len(alike))
            for name, rule in self.table_rules.items()
        }

    @classmethod
    def of(cls, optim: OptimSection, tables: list[str], fixed: Iterable[str] = ()) -> OwnUpdates:
        """``fixed``: those of ``tables`` that are fixed (not dynamic)."""
        rules = {name: make_rule(optim.table_optimizer_for(name)) for name in tables}
        known = frozenset(name for name in fixed if rules[name].stateless)
        return cls(make_rule(optim.dense_optimizer()), rules, known)

    def to_ask(self, masks: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Of ``masks`` (per table, the rows whose state an update needs), those to ask the
        servers for: not the tables whose state is :attr:`known`."""
        return {name: mask for name, mask in masks.items() if name not in self.known}

    @property
    def asks_dense_state(self) -> bool:
        """Whether the dense rule's update reads state the servers must send."""
        return not self.dense_rule.stateless

    @staticmethod
    def rows_to_ask(following: Mapping[str, Tensor], pending: Mapping[str, Tensor]) -> Asked:
        """Per table of ``following`` (a prefetched step's sorted unique ids), which of its
        rows the ``pending`` step's update will touch (those it pulled): whose state to ask.
        Every table in one search (:func:`native.places_each`), its ids and the pending
        step's joined; the masks are views of one (:attr:`StateMasks.found`)."""
        if not following:
            return Asked(StateMasks(), [], [], _NONE, [])
        names = list(following)
        touched = [pending.get(name) for name in names]
        values = [following[name].numpy() for name in names]
        others = [t.numpy() if t is not None else _NONE for t in touched]
        at, found = _search_each(values, others)
        sizes = [value.size for value in values]
        masks = StateMasks(zip(names, torch.from_numpy(found).split_with_sizes(sizes), strict=True))
        masks.found = found
        return Asked(masks, names, touched, at, sizes)

    @without_grad
    def apply(
        self,
        pulled: Pulled,
        dense_grads: Mapping[str, Tensor],
        row_grads: Mapping[str, tuple[Tensor, Tensor]],
        step: int,
        asked: Asked | None = None,
        keep_state: bool = False,
    ) -> int:
        """Apply gradients computed at training ``step``, not yet pushed, to the values of
        ``pulled``, in place, with the state it came with: ``dense_grads`` to its dense values,
        ``row_grads`` (per table: sorted unique ids and their gradients) to the rows they
        touch (``asked``: what :meth:`rows_to_ask` gave for ``pulled``'s call); returns the
        rows updated. ``keep_state``: the state is stepped too (it is where it can be, in
        place), for a later step's update."""
        self._apply_dense(pulled, dense_grads, step)
        places = asked.places if asked else {}
        states = [*self._known_state(pulled, row_grads), *pulled.row_state]
        return self._apply_rows(pulled, states, row_grads, step, places, keep_state)

    def _known_state(
        self, pulled: Pulled, grads: Mapping[str, tuple[Tensor, Tensor]]
    ) -> list[RowStates]:
        """The :attr:`known` tables' rows that may take the update, where the servers did not
        answer them: every pulled row, with no state (the update finds each one's gradient,
        and passes over a row without one, as it finds the gradients of asked rows)."""
        answered = {name for rows in pulled.row_state for name in rows.names}
        names = [
            name
            for name in grads
            if name in self.known and name in pulled.rows and name not in answered
        ]
        if not names:
            return []
        return [RowStates.every_row(names, [pulled.rows[name][0].numel() for name in names])]

    def _apply_dense(self, pulled: Pulled, grads: Mapping[str, Tensor], step: int) -> None:
        """One step of the dense rule over every pulled value with state (the servers step
        each one's at once, at one lr)."""
        rule = self.dense_rule
        if rule.stateless:  # no state asked, none read: the values and gradients alone
            names = [name for name in grads if name in pulled.dense]
            if names:
                values, lr = [pulled.dense[n] for n in names], rule.lr_at(step, "dense")
                rule.step_stateless(values, [grads[n] for n in names], lr)
            return
        blocks = []
        for name, grad in grads.items():
            state = dict(pulled.dense_state.get(name, {}))
            count = state.pop(ROW_STEPS, None)
            if count is not None and name in pulled.dense:
                blocks.append(Block(pulled.dense[name], grad, state, count))
        if blocks:
            rule.step_blocks(blocks, rule.lr_at(step, "dense"))

    def _apply_rows(
        self,
        pulled: Pulled,
        states: list[RowStates],
        grads: Mapping[str, tuple[Tensor, Tensor]],
        step: int,
        places: Mapping[str, tuple[Tensor, np.ndarray]],
        keep_state: bool,
    ) -> int:
        """The rows with state of every table: the tables of one rule in one call of its
        compiled loop where it has one (:meth:`UpdateRule.step_pulled_rows`: it finds each
        row's gradient itself, and steps the state in place whatever ``keep_state``); the
        others gathered with their gradients, the tables of one rule, lr and width stepped
        together (as on a server, where they share an arena: one call, not one per table)
        and put back."""
        updated, left = 0, list[tuple[str, RowState]]()
        for rows in states:
            stepped, left_here = self._apply_compiled(pulled, rows, grads, step)
            updated += stepped
            left.extend((rows.names[j], rows.table(j)) for j in left_here)
        together: dict[tuple[object, ...], list[_Taken]] = {}
        lrs: dict[tuple[object, ...], float] = {}
        for name, state in left:
            taken = _Taken.of(name, pulled, state, grads.get(name), places.get(name))
            if taken is not None:
                rule, lr = self.table_rules[name], self.table_rules[name].lr_at(step, name)
                width = (tuple(taken.values.shape[1:]), taken.values.dtype)
                key: tuple[object, ...] = (type(rule), rule.config, lr, width)
                together.setdefault(key, []).append(taken)
                lrs[key] = lr
        for key, group in together.items():
            _step_together(self.table_rules[group[0].name], group, lrs[key], keep_state)
        return updated + sum(t.rows.numel() for group in together.values() for t in group)

    def _apply_compiled(
        self,
        pulled: Pulled,
        rows: RowStates,
        grads: Mapping[str, tuple[Tensor, Tensor]],
        step: int,
    ) -> tuple[int, list[int]]:
        """``rows``' tables whose rule's compiled loop takes them, stepped in one call per
        rule; returns the rows updated and the tables (their places in ``rows``) left to
        torch."""
        by_rule: dict[int, list[int]] = {}
        for j, name in enumerate(rows.names):
            table_grads = grads.get(name)
            if table_grads is not None and table_grads[0].numel():
                by_rule.setdefault(self._alike[name], []).append(j)
        updated, left = 0, list[int]()
        for tables in by_rule.values():
            first = rows.names[tables[0]]
            rule = self.table_rules[first]
            lr = rule.lr_at(step, first)  # alike rules have one schedule: one lr
            pulled_tables = []
            for j in tables:
                ids, values = pulled.rows[rows.names[j]]
                pulled_tables.append(PulledTable(values, ids, *grads[rows.names[j]], lr))
            spans = rows.spans
            if spans is not None and len(tables) != len(rows.names):
                spans = spans[tables]
            stepped = rule.step_pulled_rows(PulledRows(pulled_tables, rows.at, spans, rows.parts))
            if stepped is None:
                left.extend(tables)
            else:
                updated += stepped
        return updated, left


@dataclass
class Asked:
    """What a prefetch asks the state of: per table of ``names``, a bool mask of its ids
    (``masks``), and the ids of the step whose update is pending (``touched``) with each
    asked id's place among them (``at``, every table's end to end, ``sizes`` each), so the
    update finds its gradients without searching again."""

    masks: StateMasks
    names: list[str]
    touched: list[Tensor | None]
    at: np.ndarray
    sizes: list[int]

    @functools.cached_property
    def places(self) -> dict[str, tuple[Tensor, np.ndarray]]:
        """Per table the pending step touched: its ids and each of the table's ids' place
        among them."""
        places, start = {}, 0
        for name, touched, size in zip(self.names, self.touched, self.sizes, strict=True):
            if touched is not None and touched.numel():
                places[name] = (touched, self.at[start : start + size])
            start += size
        return places


@dataclass
class _Taken:
    """One table's rows that take the pending update: their places among its pulled values,
    the values gathered, their gradients and state."""

    name: str
    values: Tensor  # every pulled row of the table, updated in place
    rows: Tensor
    taken: Tensor
    grads: Tensor
    parts: dict[str, Tensor]
    state: RowState
    state_at: Tensor | None  # the places of parts' entries in state's (None: all, in order)

    @classmethod
    def of(
        cls,
        name: str,
        pulled: Pulled,
        state: RowState,
        grads: tuple[Tensor, Tensor] | None,
        asked: tuple[Tensor, np.ndarray] | None,
    ) -> _Taken | None:
        """``asked``: the ids the state was asked against and each pulled id's place among
        them (:attr:`Asked.places`), used where the gradients' ids are those."""
        if grads is None or not state.at.numel() or not grads[0].numel():
            return None
        grad_ids, table_grads = grads
        ids, values = pulled.rows[name]
        at, parts = state.at.numpy(), dict(state.parts)
        state_at = None
        if asked is not None and torch.equal(asked[0], grad_ids):  # every asked row has one
            grad_at = asked[1][at]
        else:  # some rows take no gradient: read on demand since, or a later step's
            grad_at, found = _places(ids.numpy()[at], grad_ids.numpy())
            at, grad_at = at[found], grad_at[found]
            state_at = torch.from_numpy(np.flatnonzero(found))
            parts = {part: v.index_select(0, state_at) for part, v in parts.items()}
        rows = torch.from_numpy(at)
        gathered = table_grads.index_select(0, torch.from_numpy(grad_at))
        return cls(
            name, values, rows, values.index_select(0, rows), gathered, parts, state, state_at
        )

    def keep(self, part: str, stepped: Tensor) -> None:
        """Put ``stepped``, this table's rows' ``part`` after the update, back in its state."""
        kept = self.state.parts[part]
        if self.state_at is not None:
            kept.index_copy_(0, self.state_at, stepped)
        elif stepped.data_ptr() != kept.data_ptr():  # stepped in place where it was not joined
            kept.copy_(stepped)


def _step_together(rule: UpdateRule, group: list[_Taken], lr: float, keep_state: bool) -> None:
    """One update of every table's taken rows (joined where there are several), put back
    (with their state where ``keep_state``)."""
    if len(group) == 1:
        values, grads, parts = group[0].taken, group[0].grads, dict(group[0].parts)
    else:
        values = torch.cat([t.taken for t in group])
        grads = torch.cat([t.grads for t in group])
        parts = {part: torch.cat([t.parts[part] for t in group]) for part in group[0].parts}
    steps = parts.pop(ROW_STEPS, None)
    apply_rows(rule, values, parts, steps, torch.arange(values.shape[0]), grads, lr)
    counts = [t.rows.numel() for t in group]
    for taken, stepped in zip(group, values.split_with_sizes(counts), strict=True):
        taken.values.index_copy_(0, taken.rows, stepped)
    if keep_state:
        stepped_state = parts if steps is None else {**parts, ROW_STEPS: steps}
        for part, value in stepped_state.items():
            for taken, stepped in zip(group, value.split_with_sizes(counts), strict=True):
                taken.keep(part, stepped)


def _places(values: np.ndarray, others: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of ``values`` is in ``others`` (sorted unique, not empty), and whether it
    is there (numpy: a few cheap calls where torch's cost several microseconds each)."""
    at = np.minimum(np.searchsorted(others, values), others.size - 1)
    return at, others[at] == values


_NONE = np.empty(0, np.int64)


def _search_each(
    values: list[np.ndarray], others: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Where each table's ``values`` are among its ``others`` (sorted unique), and whether
    they are there: every table in one search (:func:`native.places_each`), joined."""
    return native.places_each(
        np.concatenate(values), tuple(v.size for v in values),
        np.concatenate(others), tuple(o.size for o in others), _places_each,
    )  # fmt: skip


def _places_each(
    values: np.ndarray,
    value_sizes: tuple[int, ...],
    others: np.ndarray,
    other_sizes: tuple[int, ...],
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`native.places_each` by numpy: :func:`_places` per segment (0, false where a
    segment has no others)."""
    at, found = np.zeros(values.size, np.int64), np.zeros(values.size, np.bool_)
    start = other_start = 0
    for size, other_size in zip(value_sizes, other_sizes, strict=True):
        if other_size and size:
            segment = slice(start, start + size)
            others_of = others[other_start : other_start + other_size]
            at[segment], found[segment] = _places(values[segment], others_of)
        start, other_start = start + size, other_start + other_size
    return at, found
