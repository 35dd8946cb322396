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

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from paramserver.config import TrainConfig
from paramserver.optim import Block, UpdateRule, apply_rows, make_rule
from paramserver.protocol import ROW_STEPS
from paramserver.trainer.client import Pulled


class OwnUpdates:
    """The update rules of the dense parameters and of each table, to step prefetched values
    as the servers will."""

    def __init__(self, dense_rule: UpdateRule, table_rules: Mapping[str, UpdateRule]):
        self.dense_rule = dense_rule
        self.table_rules = dict(table_rules)

    @classmethod
    def of(cls, config: TrainConfig, tables: list[str]) -> OwnUpdates:
        rules = {name: make_rule(config.table_optimizer_for(name)) for name in tables}
        return cls(make_rule(config.dense_optimizer()), rules)

    @property
    def asks_dense_state(self) -> bool:
        """Whether the dense rule's update reads state the servers must send."""
        return not self.dense_rule.stateless

    @staticmethod
    def rows_to_ask(
        following: Mapping[str, Tensor], pending: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """Per table of ``following`` (a prefetched step's sorted unique ids), which of its
        rows the ``pending`` step's update will touch (those it pulled): whose state to ask."""
        return {
            name: torch.from_numpy(_among(ids.numpy(), pending.get(name)))
            for name, ids in following.items()
        }

    @torch.no_grad()
    def apply(
        self,
        pulled: Pulled,
        dense_grads: Mapping[str, Tensor],
        row_grads: Mapping[str, tuple[Tensor, Tensor]],
        step: int,
    ) -> int:
        """Apply gradients computed at training ``step``, not yet pushed, to the values of
        ``pulled``, in place, with the state it came with: ``dense_grads`` to its dense values,
        ``row_grads`` (per table: sorted unique ids and their gradients) to the rows they
        touch; returns the rows updated."""
        self._apply_dense(pulled, dense_grads, step)
        return self._apply_rows(pulled, row_grads, step)

    def _apply_dense(self, pulled: Pulled, grads: Mapping[str, Tensor], step: int) -> None:
        """One step of the dense rule over every pulled value with state (the servers step
        each one's at once, at one lr)."""
        blocks = []
        for name, grad in grads.items():
            state = dict(pulled.dense_state.get(name, {}))
            count = state.pop(ROW_STEPS, None)
            if count is None and self.dense_rule.stateless:  # none asked: none read
                count = torch.zeros(())
            if count is not None and name in pulled.dense:
                blocks.append(Block(pulled.dense[name], grad, state, count))
        if blocks:
            self.dense_rule.step_blocks(blocks, self.dense_rule.lr_at(step, "dense"))

    def _apply_rows(
        self, pulled: Pulled, grads: Mapping[str, tuple[Tensor, Tensor]], step: int
    ) -> int:
        """Each table's rows with state: gathered with their gradients, stepped by the
        table's rule (in place, as on a server) and put back."""
        updated = 0
        for name, state in pulled.row_state.items():
            if name not in grads or not state.at.numel() or not grads[name][0].numel():
                continue
            grad_ids, table_grads = grads[name]
            ids, values = pulled.rows[name]
            at, parts = state.at.numpy(), dict(state.parts)
            wanted = ids.numpy()[at]
            grad_at, found = _places(wanted, grad_ids.numpy())
            if not found.all():  # rows read on demand: not in the step's recorded ids
                at, grad_at = at[found], grad_at[found]
                parts = {part: v[torch.from_numpy(found)] for part, v in parts.items()}
            rows = torch.from_numpy(at)
            stepped = values.index_select(0, rows)
            grad_rows = torch.from_numpy(grad_at)
            rule = self.table_rules[name]
            steps = parts.pop(ROW_STEPS, None)
            apply_rows(
                rule, stepped, parts, steps, torch.arange(rows.numel()),
                table_grads.index_select(0, grad_rows), rule.lr_at(step, name),
            )  # fmt: skip
            values.index_copy_(0, rows, stepped)
            updated += rows.numel()
        return updated


def _among(values: np.ndarray, others: Tensor | None) -> np.ndarray:
    """Which of ``values`` (sorted unique ids) are among ``others`` (sorted unique), as a
    bool array."""
    if others is None or not others.numel():
        return np.zeros(values.size, dtype=bool)
    return _places(values, others.numpy())[1]


def _places(values: np.ndarray, others: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of ``values`` is in ``others`` (sorted unique, not empty), and whether it
    is there (numpy: a few cheap calls where torch's cost several microseconds each)."""
    at = np.minimum(np.searchsorted(others, values), others.size - 1)
    return at, others[at] == values
