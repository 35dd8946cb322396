"""A trainer's own latest update, applied to the rows it prefetched.

Prefetching, the call that pulls step ``t``'s rows leaves while step ``t - 1`` computes, so
the servers answer it without step ``t - 1``'s gradients (they ride on the next call). Rows
both steps touch would then reach step ``t`` one update of this trainer's own behind, which
costs held-out quality wherever consecutive batches share rows (MovieLens's users, a
history's items). So the servers send the pulled rows' optimizer state with them
(``PushPullRequest.pull_state``), and the trainer applies its pending gradients to the rows
they touch by the table's own rule (:mod:`paramserver.optim`: the code the servers run), at
the learning rate the servers will (the schedule at the gradients' step).

With one trainer and no lossy gradient codec, step ``t`` then sees bitwise the rows it would
have pulled without prefetch. With several trainers it misses only the others' updates since
the read, as any async read may. Where a codec compresses the pushed gradients, the
trainer applies them uncompressed (the servers apply them decoded): the rows differ by the
codec's rounding until the next pull. Server-pooled tables and dense parameters pulled from
servers stay a step behind (their values never reach the trainer as rows); dense parameters
kept by all-reduce are the trainer's own.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from paramserver.config import TrainConfig
from paramserver.optim import UpdateRule, apply_rows, make_rule
from paramserver.protocol import ROW_HELD, ROW_STEPS
from paramserver.trainer.client import Pulled


class OwnUpdates:
    """Each table's update rule, to step prefetched rows as the servers will."""

    def __init__(self, rules: Mapping[str, UpdateRule]):
        self.rules = dict(rules)

    @classmethod
    def of(cls, config: TrainConfig, tables: list[str]) -> OwnUpdates:
        return cls({name: make_rule(config.table_optimizer_for(name)) for name in tables})

    @staticmethod
    def rows_to_ask(
        following: Mapping[str, Tensor], pending: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """Per table of ``following`` (a prefetched step's sorted unique ids), which of its
        rows the ``pending`` step's update will touch (those it pulled): whose state to ask."""
        masks = {}
        for name, ids in following.items():
            touched = pending.get(name)
            if touched is None or not touched.numel():
                masks[name] = torch.zeros(ids.numel(), dtype=torch.bool)
                continue
            at = torch.searchsorted(touched, ids).clamp_(max=touched.numel() - 1)
            masks[name] = touched[at] == ids
        return masks

    @torch.no_grad()
    def apply(self, pulled: Pulled, grads: Mapping[str, tuple[Tensor, Tensor]], step: int) -> int:
        """Apply ``grads`` (per table: sorted unique ids and their gradients, computed at
        training ``step``, not yet pushed) to the rows of ``pulled`` they touch, in place, with
        the state ``pulled`` came with; returns the rows updated."""
        updated = 0
        for name, (grad_ids, table_grads) in grads.items():
            if name not in pulled.rows or not grad_ids.numel():
                continue
            ids, values = pulled.rows[name]
            if not ids.numel():
                continue
            state = dict(pulled.row_state.get(name, {}))
            held = state.pop(ROW_HELD, None)
            if held is None:  # its state was not asked: the pull was not a prefetch
                continue
            steps = state.pop(ROW_STEPS, None)
            at = torch.searchsorted(ids, grad_ids).clamp_(max=ids.numel() - 1)
            touched = (ids[at] == grad_ids) & held[at]
            rows = at[touched]
            if not rows.numel():
                continue
            rule = self.rules[name]
            lr = rule.lr_at(step, name)
            apply_rows(rule, values, state, steps, rows, table_grads[touched], lr)
            updated += rows.numel()
        return updated
