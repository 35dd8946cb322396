"""The training loop's context: what ``loop_fn(ctx)`` gets on every trainer.

A *step* is the work between two ``ctx.step()`` calls that push (``accumulate`` batches). Its
values come from one fused call per server, which also pushes the previous step's gradients:

- **begun ahead** when the loop draws its batches through ``ctx.batches(...)``: the batches of
  the next step are drawn and recorded (the model's forward in record mode: which ids each
  table looks up) while this one computes; where the mode allows (async, SSP with a bound of
  at least 1) the call that pulls them is under way during this step's compute (prefetch),
  otherwise it leaves at ``ctx.step()``;
- **begun on demand** otherwise: the step's first training forward records the ids of its own
  arguments and makes the call before it computes.

Either way a lookup the record missed is read then and the forward runs again, so the values
are always right. A forward under ``torch.no_grad()`` (evaluation, inference) is a *look*: it
reads the rows it needs outside the step (no effect on the servers) and leaves the step's rows
and gradients as they were.

``ctx.step()`` takes the step's gradients (clipped by ``clip_grad_norm``), counts the step and
sends them with the next call: at once without prefetch when the next step is known, with the
next step's call otherwise, or with the trainer's last call when the loop returns.

The context is the loop's facade: the stages do the work (drawing batches:
:class:`~paramserver.trainer.steps.BatchSource`; recording them:
:class:`~paramserver.trainer.steps.AheadRecorder`; the calls:
:class:`~paramserver.trainer.stages.StepCalls` and
:class:`~paramserver.trainer.stages.GroupedSteps`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from paramserver.config import TrainConfig
from paramserver.errors import LoopError
from paramserver.observe import startup
from paramserver.trainer.checkpointing import set_rng_state
from paramserver.trainer.dense import OWN_OPTIMIZERS, adopt_loops_optimizer
from paramserver.trainer.ownupdates import OwnUpdates
from paramserver.trainer.replica import Call
from paramserver.trainer.stages import Engine, Gradients, GroupedSteps, StepCalls
from paramserver.trainer.steps import AheadRecorder, BatchSource, Step
from paramserver.types import Progress

log = logging.getLogger(__name__)

# The dense parameters of every live context in this process, by id, with their context:
# what an optimizer of the loop's own steps (see _before_a_loops_step).
_DENSE_OF_CONTEXTS: dict[int, tuple[weakref.ref[Tensor], weakref.ref[TrainContext]]] = {}


def _before_a_loops_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before any ``torch.optim`` step in this process: one of the loop's own over a
    trainer's dense parameters (``ctx.model.parameters()``) is that trainer's business."""
    if optimizer in OWN_OPTIMIZERS or not _DENSE_OF_CONTEXTS:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            entry = _DENSE_OF_CONTEXTS.get(id(param))
            context = entry[1]() if entry is not None and entry[0]() is param else None
            if context is not None:
                context._loops_optimizer_steps(optimizer)
                return


register_optimizer_step_pre_hook(_before_a_loops_step)


@dataclass
class Resumed:
    """Where a trainer starts: the checkpoint's step, the call number it was saved at (-1:
    none, a fresh start), the training steps and samples the trainer had done by then, its
    RNG states to restore once its data is replayed, whether it had left the job, and where
    a positioned input (a stream) was (None: read from its start, or skip ``steps``)."""

    at: int = -1
    steps: int = 0
    samples: int = 0
    rng: tuple[dict[str, Tensor], dict[str, Any]] | None = None
    left: bool = False
    position: Any = None


class TrainContext:
    """What ``loop_fn(ctx)`` gets: ``ctx.model`` (this trainer's replica: its tables stay on the
    servers), ``ctx.rank`` and ``ctx.num_trainers`` (which share of the data is this trainer's),
    ``ctx.batches(iterable)`` and ``ctx.step()``. Use it from the thread that called
    ``loop_fn`` only."""

    def __init__(self, engine: Engine, resumed: Resumed):
        self._engine = engine
        self._resumed = resumed
        self._thread = threading.get_ident()
        sections = engine.config.sections
        self._prefetch = sections.consistency.prefetches
        self._steps_per_call = sections.consistency.steps_per_call
        # Prefetching, the last step's update is applied to the rows of the next (see
        # paramserver.trainer.ownupdates), where the config asks for it; pulling every few
        # steps, each step's to the rows of the steps after it.
        own_updates = self._prefetch and sections.consistency.prefetch_own_updates
        self._own_updates = (
            OwnUpdates.of(sections.optim, list(engine.replica.tables), engine.client.plan.fixed)
            if own_updates or self._steps_per_call > 1
            else None
        )
        self._calls = StepCalls(engine, self._own_updates, self._prefetch)
        self._grouped = GroupedSteps(self._calls, self._steps_per_call)
        self._input = BatchSource(
            engine.config.accumulate, resumed.steps, resumed.position, engine.checkpoints,
            engine.activity,
        )  # fmt: skip
        self._ahead: Step | None = None  # the next step, recorded ahead
        self._forwards = 0  # training forwards since the last ctx.step()
        self._micro = 0  # batches stepped in the current step
        self._step_loss = 0.0
        self._unstepped = False  # ctx.batches gave a batch that ctx.step() has not taken
        self._batch: Any = None  # the batch ctx.batches gave last
        self._batches_open = False
        self.steps, self.samples = resumed.steps, resumed.samples
        self.last_loss = float("nan")  # the newest step's
        self.loss_sum = 0.0  # of every step's loss since this run started or resumed
        # A positioned input's position after the last step trained (what a checkpoint saves).
        self.position: Any = resumed.position
        self.step_end: Any = None  # the position after the step computing
        self._record_next: Callable[[], Step | None] | None = None  # draws ctx.batches' next
        self._drawn = False  # whether the current step drew the next one
        engine.replica.route_forward(self._model_forward)
        for param in engine.replica.dense.values():
            _DENSE_OF_CONTEXTS[id(param)] = (weakref.ref(param), weakref.ref(self))

    # ---- the public surface ----

    @property
    def model(self) -> nn.Module:
        """This trainer's replica of the model (tables remote); call it as the model. Its
        ``parameters()`` are the dense parameters only: the tables are on the servers (a
        table's ``weight`` is a placeholder that lookups read, see
        :mod:`paramserver.trainer.remote`), so regularize tables with their optimizer's
        ``weight_decay``. With ``--dense-sync allreduce`` a ``torch.optim`` optimizer of the
        loop's own may step them, once after each ``ctx.step()`` (see
        :mod:`paramserver.trainer.dense`); where the servers hold them, it is refused with a
        :class:`LoopError`."""
        return self._engine.replica.model

    @property
    def rank(self) -> int:
        """This trainer's index, 0 (the chief) to ``num_trainers - 1``."""
        return self._engine.trainer

    @property
    def num_trainers(self) -> int:
        return self._engine.config.trainers

    @property
    def config(self) -> TrainConfig:
        return self._engine.config

    @property
    def start_step(self) -> int:
        """The steps this trainer had done before this run (resumed from a checkpoint): a
        loop that reads its own data (not through ``ctx.batches``) skips that many steps."""
        return self._resumed.steps

    def batches(
        self, iterable: Iterable[Any], inputs: Callable[[Any], Any] | None = None
    ) -> Iterator[Any]:
        """Yield ``iterable``'s batches, fetching each step's rows ahead of it (see the module
        docstring). ``inputs(batch)`` gives what the loop passes to ``ctx.model``: a tuple is
        the positional arguments, anything else the one argument; by default an ``(inputs,
        target)`` pair's ``inputs``, as ``paramserver.train`` takes batches, and for other
        batches rows are fetched when the model is called. After a resume the batches trained
        before the checkpoint are skipped (a :class:`~paramserver.inputs.PositionedInput`, a
        stream, continues from its saved position instead); ``config.steps`` ends it, and so
        does a request to stop (:data:`paramserver.inputs.STOP`), at the next step."""
        self._check_thread()
        if self._batches_open:
            raise LoopError("ctx.batches is already open: use one at a time")
        return self._batches(self._input.open(iterable), inputs)

    @property
    def opened(self) -> list[Iterable[Any]]:
        """What ``ctx.batches`` read, for its input bytes."""
        return self._input.opened

    def step(self, loss: Tensor | float | None = None, samples: int | None = None) -> None:
        """After ``loss.backward()``: take this batch's gradients; every ``accumulate``-th
        call pushes them (the sum: divide the loss by ``accumulate`` for the mean; a last
        step ``ctx.batches`` ends short is scaled to a full one's weight). ``loss``
        (reported in progress, metrics and the summary) and ``samples`` (the batch's size;
        by default the first dimension of its first tensor) are for the records."""
        self._check_thread()
        self._check_step()
        engine = self._engine
        self._forwards = 0
        self._unstepped = False
        self._micro += 1
        self.samples += samples if samples is not None else _batch_size(self._batch)
        if not self._batches_open:
            self._batch = None  # the next training forward's call is the next batch
        if loss is not None:
            self._step_loss += float(loss.detach() if isinstance(loss, Tensor) else loss)
        engine.activity.touch()
        if self._micro < engine.config.accumulate:
            return
        self._end_step()

    # ---- checks ----

    def _check_thread(self) -> None:
        if threading.get_ident() != self._thread:
            raise LoopError(
                f"ctx was used from thread {threading.current_thread().name!r}; it belongs to "
                "the thread that called loop_fn (its calls to the servers are numbered in order)"
            )

    def _check_step(self) -> None:
        replica = self._engine.replica
        if self._forwards == 0:
            raise LoopError(
                "ctx.step() without a training forward since the last one: a second "
                "ctx.step() for the same batch (call it once per batch, after loss.backward())"
            )
        unknown = replica.unknown_parameters_with_grad()
        if unknown:
            raise LoopError(
                f"parameters {unknown} have gradients but the servers do not know them: "
                "they were added to ctx.model after the job started; build them in model_fn"
            )
        if not replica.has_gradients():
            raise LoopError("ctx.step() found no gradients: call loss.backward() before ctx.step()")

    def _loops_optimizer_steps(self, optimizer: torch.optim.Optimizer) -> None:
        """Before ``optimizer``, the loop's own, steps ctx.model's dense parameters."""
        self._check_thread()
        adopt_loops_optimizer(self._engine.dense, self._forwards, optimizer)

    # ---- steps ----

    def _batches(self, source: Iterator[Any], inputs: Callable[[Any], Any] | None) -> Iterator[Any]:
        positioned = self._input.positioned
        self._batches_open = True
        try:
            groups = self._input.steps(
                source, self.steps, self._engine.config.steps, self.restore_rng
            )
            engine = self._engine
            recorder = AheadRecorder(engine.replica, engine.activity, groups, inputs, positioned)
            if self._steps_per_call > 1:
                yield from self._grouped.run(self, recorder)
                step, self._grouped.leftover = self._grouped.leftover, None
            else:
                step = recorder.next()
            while step is not None:
                self._drawn = False
                if step.ids is not None:
                    self._begin_step(step, recorder.next)
                else:  # begun on demand at its first forward, which then draws the next
                    self._record_next = recorder.next
                yield from self.each_batch(step)
                self._record_next = None
                self.end_if_short(step)
                step = self._ahead if self._drawn else recorder.next()
                self._ahead = None
        finally:
            self._batches_open = False
            self._record_next = None
            close = getattr(positioned, "close", None)
            if close is not None:  # a stream's reading thread: not one read more
                close()

    def _begin_step(self, step: Step, record_next: Callable[[], Step | None] | None) -> None:
        drawn, ahead = self._calls.begin(self, step, record_next)
        if drawn:
            self._ahead, self._drawn = ahead, True

    def each_batch(self, step: Step) -> Iterator[Any]:
        """``step``'s batches, one by one, to the loop (which steps each)."""
        for batch in step.batches:
            self._batch, self._unstepped = batch, True
            yield batch
            if self._unstepped:
                raise LoopError(
                    "the loop took the next batch from ctx.batches without calling "
                    "ctx.step() for this one"
                )

    def restore_rng(self) -> None:
        """The RNG states a resume saved, once (the first step after it begins)."""
        rng, self._resumed.rng = self._resumed.rng, None
        if rng is not None:
            set_rng_state(*rng)

    def end_if_short(self, step: Step) -> None:
        """End the step the data ended inside, its gradients scaled to a full step's weight
        (``accumulate`` over its batches: with the loss divided by ``accumulate``, the mean)."""
        if len(step.batches) < self._engine.config.accumulate and self._micro:
            self._engine.replica.scale_gradients(self._engine.config.accumulate / self._micro)
            self._end_step()

    def _end_step(self) -> None:
        engine, calls = self._engine, self._calls
        replica, pulled = engine.replica, calls.pulled
        assert pulled is not None
        if engine.config.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(replica.grad_tensors(), engine.config.clip_grad_norm)
        grouped = self._grouped.current is not None
        if grouped:  # the group's earlier steps' gradients go first
            calls.pending = self._grouped.gradients_of(pulled)
        else:
            calls.pending = Gradients.of(replica, pulled.call)
        if engine.dense is not None:  # averaged among the trainers, not pushed
            engine.dense.start(calls.pending.dense, pulled.call)
            calls.pending.dense = {}
            if engine.dense.waits_for_the_loop:  # the mean, for the loop's optimizer
                engine.dense.finish()
        self._count_step()
        calls.pulled = None
        ahead = self._ahead
        if grouped:
            self._grouped.after_step()
        elif not self._prefetch and ahead is not None and ahead.ids is not None:
            calls.send(ahead)
        engine.observer.after_step(self.steps, self.samples, self.last_loss, pulled)
        if engine.on_progress is not None:
            lag, unit = self._input.lag()
            progress = Progress(engine.trainer, self.steps, self.samples, self.last_loss, lag, unit)
            engine.on_progress(progress)

    def _count_step(self) -> None:
        self.steps += 1
        if self.step_end is not None:
            self.position, self.step_end = self.step_end, None
        if self.steps == self._resumed.steps + 1:
            startup.mark("first_step")
        self.last_loss = self._step_loss
        self.loss_sum += self._step_loss
        self._micro, self._step_loss = 0, 0.0

    def finish(self) -> Gradients:
        """The trainer's, once ``loop_fn`` has returned: wait for a call still under way;
        returns the gradients the last call must push."""
        pending = self._calls.finish()
        if self._forwards:
            log.warning(
                "trainer %d: the loop ran a training forward after its last ctx.step(); "
                "its gradients are not pushed",
                self._engine.trainer,
            )
        return pending

    def close(self) -> None:
        """The trainer's, once ``loop_fn`` has ended, well or not: the model calls its own
        forward again, and its parameters are the user's to step."""
        self._engine.replica.remove_forward()
        for param in self._engine.replica.dense.values():
            _DENSE_OF_CONTEXTS.pop(id(param), None)

    # ---- the model's forward ----

    def _model_forward(self, call: Call) -> Any:
        self._check_thread()
        replica, client = self._engine.replica, self._engine.client
        if not torch.is_grad_enabled():
            return replica.look(call, client.pull)
        if self._batches_open and not self._unstepped:
            raise LoopError(
                "a training forward after ctx.step() took this batch: take the next batch "
                "from ctx.batches first (or run it under torch.no_grad())"
            )
        if self._calls.pulled is None:
            self._begin_step(Step([call], *replica.record([call])), self._record_next)
        self._forwards += 1
        if self._batch is None:
            self._batch = call
        return replica.forward_fetching(call, client.pull)


def _batch_size(batch: Any) -> int:
    """The first dimension of the first tensor in ``batch`` (1 for a batch without one)."""
    size = _first_size(batch)
    return 1 if size is None else size


def _first_size(item: Any) -> int | None:
    if isinstance(item, Tensor):
        return int(item.shape[0]) if item.dim() else 1
    if isinstance(item, Call):
        parts: Iterable[Any] = (item.args, item.kwargs)
    elif isinstance(item, dict):
        parts = item.values()
    elif isinstance(item, tuple | list):
        parts = item
    else:
        return None
    for part in parts:
        if type(part) is Tensor:  # most batches' first part: no call
            return int(part.shape[0]) if part.dim() else 1
        size = _first_size(part)
        if size is not None:
            return size
    return None
