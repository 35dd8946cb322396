"""Update rules, with torch.optim's functional implementations doing the math: servers apply
them, and a prefetching trainer applies its own last update to the values it prefetched
(:mod:`paramserver.trainer.ownupdates`), bitwise as its servers will.

A rule updates one *block*: a tensor of parameters (a whole dense parameter, or rows gathered
from a table) with its gradient, its state slots (tensors shaped like the block, or ``[rows, 1]``
for row-wise Adagrad) and one step count shared by the whole block. Tables keep a step count per
row; :func:`paramserver.rowupdates.apply_rows` groups the touched rows by the part of their step
count that changes the math (see :meth:`UpdateRule.step_group`) and runs one fused step per
group, so lazy Adam's bias correction uses each row's own count.

Learning rates: the caller passes each step's ``lr`` (the rule's base lr times its schedule's
factor at the training step of the gradients, :meth:`UpdateRule.lr_at`; see
:mod:`paramserver.schedule`), one float per block, as torch.optim's functional rules take it.

Row-wise Adagrad is the one rule written here: torch.optim has no row-wise variant (it is
FBGEMM's rule for embedding tables: one accumulator per row, the mean of the squared gradient).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.optim.adagrad import adagrad
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from paramserver import native
from paramserver.optimconfig import OptimizerConfig

State = dict[str, Tensor]
Empty = Callable[[tuple[int, ...], torch.dtype], Tensor]  # uninitialised storage of a shape


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    return torch.empty(shape, dtype=dtype)


@dataclass
class Block:
    """One block to update (see the module doc): parameters, their gradient, state slots and
    the block's 0-d step count."""

    param: Tensor
    grad: Tensor
    state: State
    step: Tensor


class UpdateRule(ABC):
    """One optimizer's update, applied in place to a block of parameters."""

    slots: tuple[str, ...] = ()
    lossy_state_ok = True
    """Whether a trainer's own update from state rounded by a lossy codec (what a server
    sends it under an int8 or fp16 pull codec) stays within one update's reach of the
    server's: Adagrad's divides by a sum that holds the gradient's own square, so it moves
    at most ``lr``; Adam's would divide its momentum by a variance rounded to 0."""

    def __init__(self, config: OptimizerConfig):
        self.config = config

    @property
    def needs_steps(self) -> bool:
        """Whether a row's step count enters the math (else tables keep none)."""
        return True

    @functools.cached_property
    def stateless(self) -> bool:
        """Whether an update reads nothing but the value, its gradient and the lr (plain
        SGD): no state slots, no step count. Asked each step: found once (a rule's config
        does not change)."""
        return not self.needs_steps and not self.init_state(torch.empty(0))

    def init_state(self, param: Tensor, empty: Empty = _empty) -> State:
        """State slots for ``param`` (a dense parameter or a table's local rows), each
        :meth:`slot_shape` and filled with :attr:`initial_value`, in storage from ``empty``
        (tables pass theirs, see :func:`~paramserver.store.growth.row_storage`)."""
        shape = self.slot_shape(param)
        return {slot: empty(shape, param.dtype).fill_(self.initial_value) for slot in self.slots}

    def slot_shape(self, param: Tensor) -> tuple[int, ...]:
        """The shape of each state slot of ``param``: its own by default."""
        return tuple(param.shape)

    @property
    def initial_value(self) -> float:
        """What every state slot starts at (:meth:`init_state` fills with it)."""
        return 0.0

    def step_group(self, steps: Tensor) -> Tensor | None:
        """Keys under which rows with these step counts can share one fused step; ``None``
        when the step count does not enter the math (all rows share one step)."""
        return steps

    def lr_at(self, step: int, group: str) -> float:
        """The lr of the update of training step ``step`` (the schedule's step, not a row's
        count of updates) for ``group`` (``"dense"`` or the table, named in a ConfigError if
        the schedule gives no valid factor)."""
        return self.config.lr_at(step, group)

    @abstractmethod
    def step(self, param: Tensor, grad: Tensor, state: State, step: Tensor, lr: float) -> None:
        """Update ``param`` and ``state`` in place at learning rate ``lr``; ``step`` is the
        block's 0-d float32 count *before* this update, and it is incremented in place."""

    def step_blocks(self, blocks: Sequence[Block], lr: float) -> None:
        """:meth:`step` on each of ``blocks``, with the same result: a rule whose torch.optim
        function takes lists overrides it to make one call for all (it runs the same kernel on
        each tensor of a list)."""
        for block in blocks:
            self.step(block.param, block.grad, block.state, block.step, lr)

    def step_stateless(self, params: Sequence[Tensor], grads: Sequence[Tensor], lr: float) -> None:
        """:meth:`step_blocks` of ``params`` with ``grads``, for a :attr:`stateless` rule,
        whose blocks have no state and whose step counts nobody reads (a trainer's own
        update of its dense values)."""
        unread = torch.zeros(())
        self.step_blocks([Block(p, g, {}, unread) for p, g in zip(params, grads, strict=True)], lr)

    def step_rows_in_place(self, updates: Sequence[RowUpdate], lr: float) -> bool:
        """Apply ``updates`` (of disjoint rows in one storage) there, each row read and written
        once, if this rule has a compiled loop for them (:mod:`paramserver.native`), with
        :meth:`step_blocks`'s result bitwise; returns whether it did (else the rows are
        gathered and stepped)."""
        return False

    def step_pulled_rows(self, rows: PulledRows) -> int | None:
        """A trainer's own update of pulled ``rows`` and their state, in place, if this rule
        has a compiled loop that takes them (:func:`paramserver.native.own_rows`: every table
        in one call), bitwise as its servers' update (:mod:`paramserver.rowupdates`); returns
        the rows updated, or None where it has none (the caller steps them as the servers
        do)."""
        return None

    def _own_loop(self, rows: PulledRows, fused: bool) -> int | None:
        """:meth:`step_pulled_rows` by the compiled loop with rounding ``fused``, unchecked
        (what the trials of a loop's rounding run; None: the loop does not take the rows)."""
        raise NotImplementedError(f"{type(self).__name__} has no compiled own update")


class SGD(UpdateRule):
    slots = ("momentum_buffer",)

    def init_state(self, param: Tensor, empty: Empty = _empty) -> State:
        return super().init_state(param, empty) if self.config.momentum else {}

    @property
    def needs_steps(self) -> bool:
        return bool(self.config.momentum)

    def step_group(self, steps: Tensor) -> Tensor | None:
        # Only the first step differs (torch starts the momentum buffer from the gradient).
        return (steps > 0).to(steps.dtype) if self.config.momentum else None

    def step_blocks(self, blocks: Sequence[Block], lr: float) -> None:
        c = self.config
        if c.momentum:  # each block's buffer is set up on its own (see step)
            super().step_blocks(blocks, lr)
            return
        if not blocks:
            return
        self.step_stateless([b.param for b in blocks], [b.grad for b in blocks], lr)
        torch._foreach_add_([b.step for b in blocks], 1)

    def step_stateless(self, params: Sequence[Tensor], grads: Sequence[Tensor], lr: float) -> None:
        c = self.config
        if c.momentum or not params:  # momentum keeps state: the blocks' own steps
            super().step_stateless(params, grads, lr)
            return
        # One foreach call over the tensors: on the CPU it runs the per-tensor add_ the single
        # tensor path runs, so the result is the same bitwise, without a Python call a tensor.
        if not c.weight_decay:  # what torch.optim's sgd comes down to then, without its checks
            torch._foreach_add_(list(params), list(grads), alpha=-lr)
        else:
            sgd(
                list(params),
                list(grads),
                [None] * len(params),
                weight_decay=c.weight_decay,
                momentum=0.0,
                lr=lr,
                dampening=c.dampening,
                nesterov=c.nesterov,
                maximize=False,
                foreach=True,
            )

    def step_rows_in_place(self, updates: Sequence[RowUpdate], lr: float) -> bool:
        # Without momentum, the state-free step the compiled loop makes as torch's add_ does.
        if self.config.momentum:
            return False
        return _rows_in_place("sgd", updates, None, lr, 0.0, self.config.weight_decay)

    def step_pulled_rows(self, rows: PulledRows) -> int | None:
        fused = None if self.config.momentum else _sgd_loop_rounding()
        return None if fused is None else self._own_loop(rows, fused)

    def _own_loop(self, rows: PulledRows, fused: bool) -> int | None:
        return _own_rows("sgd", rows, self.config, fused)

    def step(self, param: Tensor, grad: Tensor, state: State, step: Tensor, lr: float) -> None:
        c = self.config
        buffers: list[Tensor | None] = [None]
        if c.momentum and step.item() > 0:
            buffers = [state["momentum_buffer"]]
        sgd(
            [param],
            [grad],
            buffers,
            weight_decay=c.weight_decay,
            momentum=c.momentum,
            lr=lr,
            dampening=c.dampening,
            nesterov=c.nesterov,
            maximize=False,
        )
        if c.momentum:
            first = buffers[0]
            assert first is not None
            if first is not state["momentum_buffer"]:
                state["momentum_buffer"].copy_(first)
        step.add_(1)


class Adagrad(UpdateRule):
    slots = ("sum",)

    @property
    def initial_value(self) -> float:
        return self.config.initial_accumulator_value

    @property
    def needs_steps(self) -> bool:
        return bool(self.config.adagrad_lr_decay)

    def step_group(self, steps: Tensor) -> Tensor | None:
        # The step count enters the math only through adagrad_lr_decay.
        return steps if self.config.adagrad_lr_decay else None

    def step(self, param: Tensor, grad: Tensor, state: State, step: Tensor, lr: float) -> None:
        self.step_blocks([Block(param, grad, state, step)], lr)

    def step_blocks(self, blocks: Sequence[Block], lr: float) -> None:
        c = self.config
        adagrad(
            [b.param for b in blocks],
            [b.grad for b in blocks],
            [b.state["sum"] for b in blocks],
            [b.step for b in blocks],
            fused=True,
            lr=lr,
            weight_decay=c.weight_decay,
            lr_decay=c.adagrad_lr_decay,
            eps=c.resolved_eps,
            maximize=False,
        )

    def step_rows_in_place(self, updates: Sequence[RowUpdate], lr: float) -> bool:
        # torch's fused Adagrad, float32 and without lr decay (so without step counts).
        c = self.config
        if c.adagrad_lr_decay:
            return False
        return _rows_in_place("adagrad", updates, "sum", lr, c.resolved_eps, c.weight_decay)

    def step_pulled_rows(self, rows: PulledRows) -> int | None:
        fused = None if self.config.adagrad_lr_decay else _adagrad_loop_rounding()
        return None if fused is None else self._own_loop(rows, fused)

    def _own_loop(self, rows: PulledRows, fused: bool) -> int | None:
        return _own_rows("adagrad", rows, self.config, fused, slot="sum")


@functools.cache
def _adagrad_loop_rounding() -> bool | None:
    """Which rounding of the compiled Adagrad loop gives torch's results on this machine:
    multiply-adds rounded once (True) or twice (False); None where neither does, and
    torch.optim does all. Found by trying both on rows where the two differ (with and without
    weight decay) against torch's own step; None where the loops are not built."""
    if native.loops is None:
        return None
    generator = torch.Generator().manual_seed(0)
    weight, grads = _trial_rows(64, generator)
    sums = torch.rand(64, 33, generator=generator)
    for fused in (True, False):
        if all(
            _adagrad_agrees((weight, sums, grads), weight_decay, fused)
            for weight_decay in (0.0, 0.3)
        ):
            return fused
    return None


def _adagrad_agrees(
    tensors: tuple[Tensor, Tensor, Tensor], weight_decay: float, fused: bool
) -> bool:
    """Whether the loop's step of every row of ``tensors`` is bitwise torch.optim's."""
    weight, sums, grads = tensors
    looped = (weight.clone(), sums.clone())
    native.step_rows("adagrad", looped, [(torch.arange(weight.shape[0]), grads)], 0.1, eps=1e-10,
                        weight_decay=weight_decay, fused=fused)  # fmt: skip
    stepped = Block(weight.clone(), grads.clone(), {"sum": sums.clone()}, torch.zeros(()))
    rule = Adagrad(OptimizerConfig(name="adagrad", lr=0.1, weight_decay=weight_decay))
    rule.step_blocks([stepped], 0.1)
    return torch.equal(looped[0], stepped.param) and torch.equal(looped[1], stepped.state["sum"])


@functools.cache
def _rowwise_loop_agrees() -> bool:
    """Whether row-wise Adagrad's compiled own update (``sqrtf`` and a division, each rounded
    once) steps rows bitwise as the rule's torch step does on this machine: not where torch's
    square root approximates (AVX-512's is off by an ulp for about one value in six). Found
    by trying it, as :func:`_sgd_loop_rounding` finds SGD's; False where the loops are not
    built."""
    if native.loops is None:
        return False
    generator = torch.Generator().manual_seed(2)
    weight, grads = _trial_rows(256, generator)
    sums = torch.rand(256, 1, generator=generator) * 2.0
    config = OptimizerConfig(name="rowwise_adagrad", lr=0.1)
    return _own_update_agrees(config, weight, grads, {"sum": sums}, False)


@functools.cache
def _sgd_loop_rounding() -> bool | None:
    """:func:`_adagrad_loop_rounding` for plain SGD's compiled own update (torch's ``add_``
    with an alpha, which may round as the fused Adagrad kernel does not)."""
    if native.loops is None:
        return None
    weight, grads = _trial_rows(64, torch.Generator().manual_seed(1))
    for fused in (True, False):
        configs = [OptimizerConfig(name="sgd", lr=0.1, weight_decay=d) for d in (0.0, 0.3)]
        if all(_own_update_agrees(config, weight, grads, {}, fused) for config in configs):
            return fused
    return None


def _trial_rows(rows: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Rows of 33 values and their gradients, of magnitudes from 1e-3 to 1e2, to try a loop on."""
    weight = torch.randn(rows, 33, generator=generator)
    grads = torch.randn(rows, 33, generator=generator)
    return weight, grads * 10.0 ** torch.randint(-3, 3, (rows, 1), generator=generator)


def _own_update_agrees(
    config: OptimizerConfig, weight: Tensor, grads: Tensor, state: State, fused: bool
) -> bool:
    """Whether the compiled own update of rule ``config`` steps ``weight`` (every row with its
    gradient; its one state slot, if any, in ``state``) bitwise as the rule's torch step."""
    rows, rule = weight.shape[0], make_rule(config)
    looped_weight, looped_state = weight.clone(), {k: v.clone() for k, v in state.items()}
    table = PulledTable(looped_weight, torch.arange(rows), torch.arange(rows), grads, config.lr)
    rule._own_loop(PulledRows([table], np.arange(rows), np.array([[0, rows]]), looped_state), fused)
    stepped_weight, stepped_state = weight.clone(), {k: v.clone() for k, v in state.items()}
    rule.step_blocks([Block(stepped_weight, grads, stepped_state, torch.zeros(()))], config.lr)
    return torch.equal(looped_weight, stepped_weight) and all(
        torch.equal(looped_state[slot], stepped_state[slot]) for slot in state
    )


class Adam(UpdateRule):
    slots = ("exp_avg", "exp_avg_sq")
    lossy_state_ok = False

    def step(self, param: Tensor, grad: Tensor, state: State, step: Tensor, lr: float) -> None:
        self.step_blocks([Block(param, grad, state, step)], lr)

    def step_blocks(self, blocks: Sequence[Block], lr: float) -> None:
        c = self.config
        beta1, beta2 = c.betas
        adam(
            [b.param for b in blocks],
            [b.grad for b in blocks],
            [b.state["exp_avg"] for b in blocks],
            [b.state["exp_avg_sq"] for b in blocks],
            [],
            [b.step for b in blocks],
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=lr,
            weight_decay=c.weight_decay,
            eps=c.resolved_eps,
            maximize=False,
        )


class RowWiseAdagrad(UpdateRule):
    """Adagrad with one accumulator per row.

    ``s += mean(g**2)`` over the row, then ``p -= lr * g / (sqrt(s) + eps)``.
    """

    slots = ("sum",)

    def slot_shape(self, param: Tensor) -> tuple[int, ...]:
        return (param.shape[0] if param.dim() else 1, 1)

    @property
    def initial_value(self) -> float:
        return self.config.initial_accumulator_value

    def step_group(self, steps: Tensor) -> Tensor | None:
        return None

    @property
    def needs_steps(self) -> bool:
        return False

    def step_pulled_rows(self, rows: PulledRows) -> int | None:
        # The means by torch (its reduction's order), the rest by the loop where its division
        # and square root round as torch's do; weight decay's add is left to torch.
        if self.config.weight_decay or not _rowwise_loop_agrees():
            return None
        return self._own_loop(rows, False)

    def _own_loop(self, rows: PulledRows, fused: bool) -> int | None:
        means = [t.grads.square().mean(dim=1) for t in rows.tables]
        return _own_rows("rowwise_adagrad", rows, self.config, fused, slot="sum", means=means)

    def step(self, param: Tensor, grad: Tensor, state: State, step: Tensor, lr: float) -> None:
        c = self.config
        if c.weight_decay:
            grad = grad.add(param, alpha=c.weight_decay)
        accumulator = state["sum"]
        accumulator.add_(grad.square().mean(dim=1, keepdim=True))
        param.addcdiv_(grad, accumulator.sqrt().add_(c.resolved_eps), value=-lr)
        step.add_(1)


RULES: dict[str, type[UpdateRule]] = {
    "sgd": SGD,
    "adagrad": Adagrad,
    "rowwise_adagrad": RowWiseAdagrad,
    "adam": Adam,
}


def make_rule(config: OptimizerConfig) -> UpdateRule:
    return RULES[config.name](config)


@dataclass
class RowUpdate:
    """Gradients for rows of one table: ``weight[rows]`` (``rows`` unique) with ``grads``, its
    state slots and per-row step counts (None for a rule whose math ignores them)."""

    weight: Tensor
    state: State
    steps: Tensor | None
    rows: Tensor
    grads: Tensor


@dataclass
class PulledTable:
    """A table's rows a trainer pulled, to take its own update: ``values`` (every pulled row,
    stepped in place) of sorted ``ids``, its step's gradients (``grads`` of the sorted unique
    ``grad_ids``; a row whose id is not among them takes none) and ``lr``."""

    values: Tensor
    ids: Tensor
    grad_ids: Tensor
    grads: Tensor
    lr: float


@dataclass
class PulledRows:
    """Tables' pulled rows that came with state, to take a trainer's own update: ``at``, their
    places among their table's values, every table's end to end (int64), table ``j``'s from
    ``spans[j, 0]`` to ``spans[j, 1]``; ``state``, its slots aligned with ``at`` (stepped in
    place). ``at`` and ``spans`` None: every row of each table, in order, with no state."""

    tables: list[PulledTable]
    at: np.ndarray | None
    spans: np.ndarray | None
    state: State


def _rows_in_place(
    kind: str,
    updates: Sequence[RowUpdate],
    slot: str | None,
    lr: float,
    eps: float,
    weight_decay: float,
) -> bool:
    """:meth:`UpdateRule.step_rows_in_place` by the compiled loop of rule ``kind`` (its state:
    ``slot``, or none), where the loops take the tensors and a rounding that gives torch's
    results was found; returns whether it stepped them."""
    first = updates[0]
    storage = (first.weight, None if slot is None else first.state[slot])
    tensors = [t for t in storage if t is not None] + [update.grads for update in updates]
    if first.steps is not None or not native.takes_rows(*tensors):
        return False
    fused = _adagrad_loop_rounding() if kind == "adagrad" else _sgd_loop_rounding()
    if fused is None:
        return False
    parts = [(update.rows, update.grads) for update in updates]
    native.step_rows(kind, storage, parts, lr, eps=eps, weight_decay=weight_decay, fused=fused)
    return True


def _own_rows(
    kind: str,
    rows: PulledRows,
    config: OptimizerConfig,
    fused: bool,
    slot: str | None = None,
    means: Sequence[Tensor] | None = None,
) -> int | None:
    """:func:`paramserver.native.own_rows` of ``rows`` (state: their ``slot``; ``means``:
    row-wise Adagrad's, per table), or None where the loops do not take their tensors."""
    state = rows.state.get(slot) if slot else None
    tables = rows.tables
    if set(rows.state) != ({slot} if slot else set()) or not native.takes_rows(
        *(t.values for t in tables),
        *(t.grads for t in tables),
        *([state] if state is not None else []),
    ):
        return None
    parts = [
        (
            t.values, t.values.shape[1], native.int64s(t.ids), native.int64s(t.grad_ids), t.grads,
            None if means is None else means[j], t.lr,
        )
        for j, t in enumerate(tables)
    ]  # fmt: skip
    at, spans = (
        (None, None) if rows.at is None or rows.spans is None
        else (np.ascontiguousarray(rows.at, np.int64), np.ascontiguousarray(rows.spans, np.int64))
    )  # fmt: skip
    return native.own_rows(
        kind, parts, at, state, spans,
        eps=config.resolved_eps, weight_decay=config.weight_decay, fused=fused,
    )  # fmt: skip
