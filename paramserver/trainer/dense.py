"""Dense parameters kept by the trainers (``--dense-sync allreduce``).

Every trainer holds the dense parameters (the same seeded values at the start); each step it
averages their gradients with the other trainers through the trainers' group
(:mod:`paramserver.transport.group`) and applies the job's dense rule and schedule here, with
``torch.optim`` (the math the servers' rules run), so every trainer holds the same values. The
all-reduce starts as soon as the step's gradients are taken and runs while the step's table
push and the next step's pull are under way; the update is applied once they are back, before
the next step computes (or before the job ends). Where the mode allows a step of staleness
(async, and SSP with a bound of at least 1: where rows are prefetched) it is applied only
before the step after next, so the all-reduce runs during a whole step: dense values are one
update behind, as prefetched values pulled from the servers are.

A step's gradient missing on a trainer (a parameter its batches did not reach) counts as zero
in the mean. Trainers may have unequal data, as DDP's ``Join`` allows: each all-reduce also
sums a flag of the trainers still training, the mean is over them, and a trainer whose loop
has ended keeps joining the all-reduces with nothing to add (:meth:`AllReducedDense.drain`),
applying the others' updates, until none is left training.

Checkpoints hold the state once, from the chief, under the servers' names
(``dense/NAME/value``, ``dense/NAME/state.SLOT``, ``dense/NAME/step``), so a job can resume
with either ``--dense-sync``.

A loop may step the dense parameters with a ``torch.optim`` optimizer of its own, as with DDP:
after ``ctx.step()``, ``optimizer.step()``. The first such step hands the parameters to it
(:meth:`AllReducedDense.adopt`): from then on ``ctx.step()`` waits for its all-reduce and leaves
the mean in each parameter's ``.grad`` for the loop's optimizer, which is the one checkpoints
save, and which steps the updates of trainers still training once this one's loop has ended.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from paramserver.checkpoint import Saved
from paramserver.errors import LoopError
from paramserver.observe.calls import CallProfile
from paramserver.optimconfig import OptimizerConfig
from paramserver.trainer.heartbeat import Activity
from paramserver.transport.group import Reduction, TrainerGroup

OWN_OPTIMIZERS: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
"""The optimizers paramserver made for trainers' dense parameters (not the user's)."""


def torch_optimizer(params: list[nn.Parameter], rule: OptimizerConfig) -> torch.optim.Optimizer:
    """``rule`` as a ``torch.optim`` optimizer over ``params``, running the same single-tensor
    (fused, for Adagrad) math as the servers' update rules."""
    if rule.name == "sgd":
        return torch.optim.SGD(
            params, lr=rule.lr, momentum=rule.momentum, dampening=rule.dampening,
            nesterov=rule.nesterov, weight_decay=rule.weight_decay, foreach=False,
        )  # fmt: skip
    if rule.name == "adagrad":
        return torch.optim.Adagrad(
            params, lr=rule.lr, lr_decay=rule.adagrad_lr_decay, weight_decay=rule.weight_decay,
            initial_accumulator_value=rule.initial_accumulator_value, eps=rule.resolved_eps,
            fused=True,
        )  # fmt: skip
    if rule.name == "adam":
        return torch.optim.Adam(
            params, lr=rule.lr, betas=rule.betas, eps=rule.resolved_eps,
            weight_decay=rule.weight_decay, foreach=False,
        )  # fmt: skip
    raise ValueError(f"no trainer-side dense rule {rule.name!r}")  # refused by TrainConfig


class AllReducedDense:
    """The dense parameters of one trainer under ``--dense-sync allreduce``."""

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        rule: OptimizerConfig,
        group: TrainerGroup,
        activity: Activity,
        profile: CallProfile | None = None,
    ):
        """``profile`` records each step's all-reduce as the pseudo-operations ``allreduce``
        (the bytes handed to it; from its start to its end) and ``allreduce_wait`` (the part of
        that the step waited for: what the overlap did not hide)."""
        self.params = params
        self.rule = rule
        self.group = group
        self.activity = activity
        self.profile = profile
        self.optimizer = torch_optimizer(list(params.values()), rule)
        OWN_OPTIMIZERS.add(self.optimizer)
        self.loops_optimizer: torch.optim.Optimizer | None = None  # see adopt
        self.loop_running = True  # the loop steps the loop's optimizer (until drain)
        self._mean_waiting = False  # a mean is in the gradients for the loop's optimizer
        self._resumed = False  # the optimizer's state came from a checkpoint
        self.updates = 0  # updates applied (the servers' version of each dense value)
        # All-reduces under way, oldest first: (reduction, gradients, flag, step, started at).
        self._pending: deque[tuple[Reduction, list[Tensor], Tensor, int, float]] = deque()
        self._next_step = 0  # the step of the next all-reduce (they go in lock step)
        # Every trainer starts from the chief's values: seeded builds agree, but threads of
        # one process share torch's RNG, and a model_fn may not be deterministic.
        with torch.no_grad(), self._waiting():
            group.broadcast_from_chief(list(params.values()))

    def start(self, grads: dict[str, Tensor], step: int, training: bool = True) -> None:
        """Start averaging the gradients of training step ``step`` (0 for the first) over the
        trainers still training (``training`` False: this one's loop has ended)."""
        ordered = [
            grads[name] if name in grads else torch.zeros_like(param)
            for name, param in self.params.items()
        ]
        active = torch.tensor([1.0 if training else 0.0])
        self._next_step = step + 1
        started = time.perf_counter()
        with self._waiting():  # the threads' group reduces at once, waiting for every member
            reduction = self.group.all_reduce_sum([*ordered, active])
        self._pending.append((reduction, ordered, active, step, started))

    def finish(self, keep: int = 0) -> int:
        """Wait for the oldest all-reduces under way until ``keep`` are left, applying each
        mean over the trainers that were training; returns how many were, in the last one
        (0: none, and nothing applied; none finished: -1)."""
        training = -1
        while len(self._pending) > keep:
            reduction, grads, active, step, started = self._pending.popleft()
            waited_from = time.perf_counter()
            with self._waiting():
                reduction.wait()
            self._record(grads, started, waited_from)
            training = int(active.item())
            if training:
                self._apply(grads, training, step)
        return training

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Before a step of ``optimizer``, the loop's own, over these parameters: from now on
        it applies the updates (see the module docstring). Raises :class:`LoopError` for a
        second optimizer, one that steps only some of the parameters, one stepped twice after
        one ``ctx.step()``, or one of another kind than the checkpoint's state resumed here."""
        if self.loops_optimizer is None:
            self._take(optimizer)
        elif optimizer is not self.loops_optimizer:
            raise LoopError(
                "a second optimizer of the loop's own steps ctx.model's dense parameters; "
                "step them all with one (param_groups give parts their own settings)"
            )
        self.finish()  # the first time: the ctx.step() before, begun without waiting
        if not self._mean_waiting:
            raise LoopError(
                "the loop's optimizer stepped without a ctx.step() before it: call "
                "optimizer.step() once after each ctx.step() that pushes (ctx.step() averages "
                "the gradients over the trainers)"
            )
        self._mean_waiting = False
        self.updates += 1

    def _take(self, optimizer: torch.optim.Optimizer) -> None:
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = sorted(n for n, p in self.params.items() if id(p) not in stepped)
        if missing:
            raise LoopError(
                f"the loop's optimizer steps only some of ctx.model's dense parameters (not "
                f"{missing}): give it all of ctx.model.parameters()"
            )
        if self._resumed:  # the checkpoint's state goes on in the loop's optimizer
            if type(optimizer) is not type(self.optimizer):
                raise LoopError(
                    f"the checkpoint holds {type(self.optimizer).__name__} state for the "
                    f"dense parameters, but the loop steps them with "
                    f"{type(optimizer).__name__}: set the job's optimizer to the loop's kind"
                )
            for param in self.params.values():
                optimizer.state[param] = self.optimizer.state[param]
        self.loops_optimizer = self.optimizer = optimizer

    def drain(self) -> None:
        """This trainer's loop has ended (and it has left the servers' rounds): join the
        others' all-reduces, adding nothing and applying their updates, until no trainer is
        training."""
        self.loop_running = False
        self.finish()
        while True:
            self.start({}, self._next_step, training=False)
            if self.finish() == 0:
                return

    @property
    def waits_for_the_loop(self) -> bool:
        """Whether the loop's optimizer applies the updates: ``ctx.step()`` then waits for
        its all-reduce, so that the mean is in the gradients when the loop steps."""
        return self.loops_optimizer is not None and self.loop_running

    @torch.no_grad()
    def _apply(self, sums: list[Tensor], training: int, step: int) -> None:
        if self._mean_waiting:
            raise LoopError(
                "the loop's optimizer did not step after the last ctx.step(): call "
                "optimizer.step() once after each ctx.step() that pushes"
            )
        for param, grad in zip(self.params.values(), sums, strict=True):
            param.grad = grad.div_(training)
        if self.waits_for_the_loop:
            self._mean_waiting = True
            return
        if self.loops_optimizer is None:  # the loop's optimizer keeps its own rates
            for group in self.optimizer.param_groups:
                group["lr"] = self.rule.lr_at(step, "dense")
        self.optimizer.step()
        self.updates += 1
        for param in self.params.values():
            param.grad = None

    def _record(self, grads: list[Tensor], started: float, waited_from: float) -> None:
        if self.profile is None:
            return
        done = time.perf_counter()
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        self.profile.sent("allreduce", nbytes)
        self.profile.answered("allreduce", done - started, nbytes)
        self.profile.answered("allreduce_wait", done - waited_from, 0)

    @contextmanager
    def _waiting(self) -> Iterator[None]:
        """Waiting on the other trainers, like a call to a server, is not being idle."""
        self.activity.call_started()
        try:
            yield
        finally:
            self.activity.call_ended()

    def saved(self, signature: dict[str, Any], num_servers: int) -> Saved:
        """The checkpoint's dense part: values and optimizer state under the servers' names,
        with a server part's metadata (no server, no tables)."""
        tensors: dict[str, Tensor] = {}
        for name, param in self.params.items():
            tensors[f"dense/{name}/value"] = param.detach().clone()
            for slot, value in self.optimizer.state.get(param, {}).items():
                if slot != "step":
                    tensors[f"dense/{name}/state.{slot}"] = value.clone()
            tensors[f"dense/{name}/step"] = torch.tensor(float(self.updates))
        meta = {
            "server": None,
            "num_servers": num_servers,
            "dense": sorted(self.params),
            "tables": {},
            "signature": signature,
        }
        return tensors, meta

    @torch.no_grad()
    def restore(self, saved: dict[str, Tensor]) -> None:
        """Take the values and optimizer state of a checkpoint (:func:`saved_dense`: saved
        under either ``--dense-sync``)."""
        self._resumed = True
        for name, param in self.params.items():
            param.copy_(saved[f"dense/{name}/value"])
            updates = saved[f"dense/{name}/step"]
            slots = {
                key.rsplit(".", 1)[1]: value
                for key, value in saved.items()
                if key.startswith(f"dense/{name}/state.")
            }
            state = self.optimizer.state[param]
            state.clear()
            if self.rule.name != "sgd":
                state["step"] = updates.clone().to(torch.float32)
            if self.rule.name != "sgd" or float(updates) > 0:  # torch starts momentum lazily
                state.update({slot: value.clone() for slot, value in slots.items()})
            self.updates = int(updates)


def adopt_loops_optimizer(
    dense: AllReducedDense | None, forwards: int, optimizer: torch.optim.Optimizer
) -> None:
    """Before ``optimizer``, the loop's own, steps ctx.model's dense parameters: with
    ``--dense-sync allreduce`` (``dense``) it may, after ``ctx.step()`` (no training forward
    since: ``forwards`` 0); where the servers hold them it may not (:class:`LoopError`)."""
    if dense is None:
        raise LoopError(
            "an optimizer of the loop's own steps ctx.model's dense parameters, but the "
            "servers hold them and apply the job's dense rule: this trainer's copy is "
            "overwritten by the next pull, so the step would have no effect. Set the rule "
            "in the job's config (optimizer, lr, momentum, weight_decay, the schedule; "
            "table_optimizer for the tables), or keep the dense parameters on the "
            "trainers with --dense-sync allreduce, where the loop's optimizer steps them"
        )
    if forwards:
        raise LoopError(
            "the loop's optimizer stepped after a training forward without ctx.step(): "
            "call optimizer.step() after ctx.step(loss), which averages the dense "
            "gradients over the trainers"
        )
    dense.adopt(optimizer)
