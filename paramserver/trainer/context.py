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
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from paramserver.config import TrainConfig
from paramserver.errors import LoopError
from paramserver.inputs import STOP, PositionedInput
from paramserver.observe import startup
from paramserver.trainer.checkpointing import TrainerCheckpoints, rng_state, set_rng_state
from paramserver.trainer.client import InFlight, PSClient, Pulled, StepPush
from paramserver.trainer.dense import OWN_OPTIMIZERS, AllReducedDense
from paramserver.trainer.heartbeat import Activity
from paramserver.trainer.observer import Observer
from paramserver.trainer.ownupdates import Asked, OwnUpdates
from paramserver.trainer.replica import Call, Replica
from paramserver.trainer.steps import AheadRecorder, Group, Step
from paramserver.types import Progress
from paramserver.wire.reports import TrainerReport

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
class Gradients:
    """A step's gradients, waiting to ride on the next call."""

    dense: dict[str, Tensor] = field(default_factory=dict)
    rows: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    pooled: dict[str, tuple[int, Tensor]] = field(default_factory=dict)
    pull_call: int = -1  # the call whose answer they were computed from
    step: int = -1  # their training step, where it is not pull_call (steps per call > 1)
    # The steps before it computed from the same pull, pushed by calls of their own before it.
    earlier: list[StepPush] = field(default_factory=list)

    @classmethod
    def of(cls, replica: Replica, pull_call: int, step: int = -1) -> Gradients:
        dense, rows = replica.gradients()
        pooled = {name: (pull_call, g) for name, g in replica.pooled_gradients().items()}
        return cls(dense, rows, pooled, pull_call, step)

    def with_earlier(self) -> list[StepPush]:
        """These gradients (if any) after the earlier ones: what a later step pushes first."""
        if self.pull_call < 0:
            return []
        return [*self.earlier, StepPush(self.dense, self.rows, self.pull_call, self.step)]

    def push(
        self,
        client: PSClient,
        following: Step | None,
        state_masks: dict[str, Tensor] | None = None,
        dense_state: bool = False,
        final: bool = False,
        report: TrainerReport | None = None,
    ) -> InFlight:
        """Send these gradients, pulling what ``following`` needs (and the optimizer state of
        the rows ``state_masks`` pick, and with ``dense_state`` of the dense values); they are
        then spent."""
        in_flight = client.push_pull(
            self.dense,
            self.rows,
            following.ids or {} if following else {},
            pool_bags=following.bags if following else {},
            pooled_grads=self.pooled,
            pull_dense=following is not None,
            final=final,
            report=report,
            grads_call=self.pull_call,
            grads_step=self.step,
            pull_state=state_masks,
            pull_dense_state=dense_state,
            earlier=self.earlier,
        )
        self.dense, self.rows, self.pooled, self.pull_call, self.step = {}, {}, {}, -1, -1
        self.earlier = []
        return in_flight


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


@dataclass
class Engine:
    """The pieces of a trainer the context drives."""

    trainer: int
    config: TrainConfig
    replica: Replica
    client: PSClient
    checkpoints: TrainerCheckpoints
    activity: Activity
    observer: Observer
    on_progress: Callable[[Progress], None] | None
    dense: AllReducedDense | None = None  # --dense-sync allreduce: the trainer's own


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
        self._group: Group | None = None  # the steps computing from the current pull
        self._next_group: Group | None = None  # drawn and recorded while it was pulled
        self._leftover: Step | None = None  # a step drawn without its lookups: ends grouping
        self._pending = Gradients()  # the last step's, not sent yet
        self._in_flight: InFlight | None = None
        self._in_flight_pulls: Step | None = None  # the step whose values it pulls
        self._in_flight_asked: Asked | None = None  # the state it asks, prefetching
        self._to_skip = resumed.steps * engine.config.accumulate  # batches trained before
        self._pulled: Pulled | None = None  # the current step's answer (None: not begun)
        self._last_call: int | None = None  # the newest call answered
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
        self.opened: list[Iterable[Any]] = []  # what ctx.batches read, for its input bytes
        # A positioned input's position after the last step trained (what a checkpoint saves).
        self.position: Any = resumed.position
        self._step_end: Any = None  # the position after the step computing
        self._positioned: PositionedInput | None = None  # what ctx.batches reads, a stream
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
        self.opened.append(iterable)
        positioned = iterable if isinstance(iterable, PositionedInput) else None
        self._positioned = positioned
        if positioned is not None:
            if self._resumed.position is not None:
                positioned.seek(self._resumed.position)
                self._to_skip = 0
            self._engine.checkpoints.stream = positioned
            if hasattr(positioned, "on_idle"):  # waiting for new records is not being stuck
                positioned.on_idle = self._engine.activity.touch
        return self._batches(iter(iterable), inputs)

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
        """Before ``optimizer``, the loop's own, steps ctx.model's dense parameters: with
        ``--dense-sync allreduce`` it may (see :mod:`paramserver.trainer.dense`), after
        ``ctx.step()``; where the servers hold them it may not."""
        self._check_thread()
        dense = self._engine.dense
        if dense is None:
            raise LoopError(
                "an optimizer of the loop's own steps ctx.model's dense parameters, but the "
                "servers hold them and apply the job's dense rule: this trainer's copy is "
                "overwritten by the next pull, so the step would have no effect. Set the rule "
                "in the job's config (optimizer, lr, momentum, weight_decay, the schedule; "
                "table_optimizer for the tables), or keep the dense parameters on the "
                "trainers with --dense-sync allreduce, where the loop's optimizer steps them"
            )
        if self._forwards:
            raise LoopError(
                "the loop's optimizer stepped after a training forward without ctx.step(): "
                "call optimizer.step() after ctx.step(loss), which averages the dense "
                "gradients over the trainers"
            )
        dense.adopt(optimizer)

    # ---- steps ----

    def _batches(self, source: Iterator[Any], inputs: Callable[[Any], Any] | None) -> Iterator[Any]:
        positioned = self._positioned
        self._batches_open = True
        try:
            groups = self._groups(self._replayed(source))
            engine = self._engine
            recorder = AheadRecorder(engine.replica, engine.activity, groups, inputs, positioned)
            if self._steps_per_call > 1:
                yield from self._grouped(recorder)
                step, self._leftover = self._leftover, None
            else:
                step = recorder.next()
            while step is not None:
                self._drawn = False
                if step.ids is not None:
                    self._begin_step(step, recorder.next)
                else:  # begun on demand at its first forward, which then draws the next
                    self._record_next = recorder.next
                yield from self._each_batch(step)
                self._record_next = None
                self._end_if_short(step)
                step = self._ahead if self._drawn else recorder.next()
                self._ahead = None
        finally:
            self._batches_open = False
            self._record_next = None
            close = getattr(positioned, "close", None)
            if close is not None:  # a stream's reading thread: not one read more
                close()

    def _grouped(self, recorder: AheadRecorder) -> Iterator[Any]:
        """``steps_per_call`` steps at a time from one pull, while their lookups are recorded
        (a step drawn without them is left in ``_leftover``, for one call per step)."""
        group = self._draw_group(recorder)
        while group is not None:
            self._begin_group(group, recorder)
            for at, step in enumerate(group.steps):
                self._load_group_step(group, at)
                yield from self._each_batch(step)
                self._end_if_short(step)
            group, self._next_group = self._next_group, None

    def _draw_group(self, recorder: AheadRecorder) -> Group | None:
        """Up to ``steps_per_call`` recorded steps (None: none left)."""
        steps: list[Step] = []
        while self._leftover is None and len(steps) < self._steps_per_call:
            step = recorder.next()
            if step is None:
                break
            if step.ids is None:
                self._leftover = step
            else:
                steps.append(step)
        return Group.of(steps) if steps else None

    def _begin_group(self, group: Group, recorder: AheadRecorder) -> None:
        """Get ``group``'s values (sending its call unless it is under way), drawing and
        recording the next group meanwhile."""
        engine = self._engine
        self._restore_rng()
        if self._in_flight is None:
            self._send_group(group)
        assert self._in_flight is not None and self._in_flight_pulls is group.steps[0]
        rng = rng_state() if engine.checkpoints.enabled else None
        self._next_group = self._draw_group(recorder)
        pulled = self._in_flight.wait()
        self._in_flight = None
        self._last_call = pulled.call
        engine.checkpoints.after_reply(
            pulled.call, pulled.checkpoint_at, self.steps, self.samples, rng, self.position
        )
        group.values, self._group = pulled, group

    def _send_group(self, group: Group) -> None:
        """Push the pending steps, each with a call of its own, and pull ``group``'s rows (with
        the state of those several of its steps touch) in one message per server."""
        own = self._own_updates if len(group.steps) > 1 else None
        masks = own.to_ask(group.masks) if own is not None else None
        dense_state = own is not None and own.asks_dense_state
        following = Step([], group.ids)
        self._in_flight = self._pending.push(self._engine.client, following, masks, dense_state)
        self._in_flight_pulls, self._in_flight_asked = group.steps[0], None

    def _load_group_step(self, group: Group, at: int) -> None:
        group.at, self._pulled = at, group.step_values(at)
        step = group.steps[at]
        self._step_end = step.end
        self._engine.replica.load(self._pulled.dense, self._pulled.rows, {}, step.lookups)

    def _after_group_step(self, group: Group) -> None:
        """Once a step of ``group`` has its gradients pending: apply them to the values the
        group's later steps load, or after its last, send them all with the next group's
        pull."""
        pending, own = self._pending, self._own_updates
        assert own is not None and group.values is not None
        if group.at < len(group.steps) - 1:
            own.apply(group.values, pending.dense, pending.rows, pending.step, keep_state=True)
            return
        self._group = None
        following = self._next_group
        if following is not None:
            # The checkpoint step is the message's last call: the one that pulls.
            self._engine.checkpoints.announce_if_due(
                self._engine.client.next_call + len(pending.earlier) - 1
            )
            self._send_group(following)

    def _each_batch(self, step: Step) -> Iterator[Any]:
        for batch in step.batches:
            self._batch, self._unstepped = batch, True
            yield batch
            if self._unstepped:
                raise LoopError(
                    "the loop took the next batch from ctx.batches without calling "
                    "ctx.step() for this one"
                )

    def _replayed(self, source: Iterator[Any]) -> Iterator[Any]:
        """``source`` past the batches trained before the checkpoint (over as many
        ``ctx.batches`` as they span); the trainer's RNG states are restored after them (the
        data may draw from them)."""
        if self._to_skip:
            self._to_skip -= sum(1 for _ in itertools.islice(source, self._to_skip))
        if not self._to_skip:
            self._restore_rng()
        return source

    def _input_lag(self) -> tuple[int | None, str]:
        """How far the head of the stream being read is ahead of this trainer, if it says."""
        lag = getattr(self._positioned, "lag", None)
        if lag is None:
            return None, ""
        return lag(), getattr(self._positioned, "lag_unit", "")

    def _restore_rng(self) -> None:
        rng, self._resumed.rng = self._resumed.rng, None
        if rng is not None:
            set_rng_state(*rng)

    def _groups(self, source: Iterator[Any]) -> Iterator[list[Any]]:
        """``accumulate`` batches at a time, up to ``config.steps`` steps of the job."""
        config = self._engine.config
        steps = self.steps
        while (config.steps is None or steps < config.steps) and not STOP.is_set():
            group = list(itertools.islice(source, config.accumulate))
            if not group:
                return
            steps += 1
            yield group

    def _begin_step(self, step: Step, record_next: Callable[[], Step | None] | None) -> None:
        """Get ``step``'s values (sending the call unless one is under way); draw and record
        the next step with ``record_next`` (None: the loop's own data, unknown until its first
        forward) and, prefetching, send the last step's gradients at once, with the next
        step's pull where it is recorded; then load the values into the replica."""
        engine = self._engine
        self._restore_rng()
        if self._in_flight is not None and self._in_flight_pulls is not step:
            self._last_call = self._in_flight.wait().call  # a push that pulled nothing
            self._in_flight = None
        if self._in_flight is None:
            if self._last_call is not None:  # a next step exists: this one
                engine.checkpoints.announce_if_due(self._last_call)
            self._send(step)
        assert self._in_flight is not None
        # The next step is drawn and recorded while the call is under way; a checkpoint saves
        # the RNG states from before it was drawn.
        rng = rng_state() if record_next is not None and engine.checkpoints.enabled else None
        ahead = record_next() if record_next is not None else None
        pulled = self._in_flight.wait()
        self._in_flight = None
        # The pending gradients are not in the answer: applied to it once the next call,
        # which pushes them, is under way (the servers' work then overlaps the trainer's).
        pending = self._pending
        own = (pending.dense, pending.rows, pending.pull_call, self._in_flight_asked)
        # Before a checkpoint's part is saved, and before computing; prefetching (the mode
        # allows a step of staleness), the last step's all-reduce may go on during this one.
        self._apply_dense(keep=1 if self._prefetch else 0)
        self._pulled, self._last_call = pulled, pulled.call
        engine.checkpoints.after_reply(
            pulled.call, pulled.checkpoint_at, self.steps, self.samples, rng, self.position
        )
        self._step_end = step.end
        if record_next is not None:
            self._ahead, self._drawn = ahead, True
            if ahead is not None:
                engine.checkpoints.announce_if_due(pulled.call)
            if self._prefetch and (ahead is None or ahead.ids is not None):
                self._send(ahead, pending_of=step)
        if self._own_updates is not None:
            self._own_updates.apply(pulled, *own)
        engine.replica.load(
            pulled.dense,
            pulled.rows,
            {name: (pulled.pooled[name], bags) for name, bags in step.bags.items()},
            step.lookups,
        )

    def _end_if_short(self, step: Step) -> None:
        if len(step.batches) < self._engine.config.accumulate and self._micro:
            self._end_short_step()

    def _end_short_step(self) -> None:
        """End the step the data ended inside, its gradients scaled to a full step's weight
        (``accumulate`` over its batches: with the loss divided by ``accumulate``, the mean)."""
        self._engine.replica.scale_gradients(self._engine.config.accumulate / self._micro)
        self._end_step()

    def _apply_dense(self, keep: int = 0) -> None:
        if self._engine.dense is not None:
            self._engine.dense.finish(keep)

    def _send(self, following: Step | None, pending_of: Step | None = None) -> None:
        """Start the call that pushes the pending gradients and pulls ``following``'s values;
        ``pending_of``: the step whose gradients will be pending when it is answered (a
        prefetch), whose own update is then applied to the rows both touch."""
        asked, dense_state = None, False
        own = self._own_updates
        if own is not None and following is not None and pending_of is not None:
            asked = own.rows_to_ask(following.ids or {}, pending_of.ids or {})
            dense_state = own.asks_dense_state
        masks = own.to_ask(asked.masks) if own is not None and asked is not None else None
        self._in_flight = self._pending.push(self._engine.client, following, masks, dense_state)
        self._in_flight_pulls, self._in_flight_asked = following, asked

    def _end_step(self) -> None:
        engine = self._engine
        replica, pulled = engine.replica, self._pulled
        assert pulled is not None
        if engine.config.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(replica.grad_tensors(), engine.config.clip_grad_norm)
        group = self._group
        if group is None:
            self._pending = Gradients.of(replica, pulled.call)
        else:  # the group's earlier steps' gradients go first
            earlier = self._pending.with_earlier()
            self._pending = Gradients.of(replica, pulled.call, pulled.call + group.at)
            self._pending.earlier = earlier
        if engine.dense is not None:  # averaged among the trainers, not pushed
            engine.dense.start(self._pending.dense, pulled.call)
            self._pending.dense = {}
            if engine.dense.waits_for_the_loop:  # the mean, for the loop's optimizer
                engine.dense.finish()
        self.steps += 1
        if self._step_end is not None:
            self.position, self._step_end = self._step_end, None
        if self.steps == self._resumed.steps + 1:
            startup.mark("first_step")
        self.last_loss = self._step_loss
        self.loss_sum += self._step_loss
        self._micro, self._step_loss, self._pulled = 0, 0.0, None
        ahead = self._ahead
        if group is not None:
            self._after_group_step(group)
        elif not self._prefetch and ahead is not None and ahead.ids is not None:
            self._send(ahead)
        engine.observer.after_step(self.steps, self.samples, self.last_loss, pulled)
        if engine.on_progress is not None:
            lag, unit = self._input_lag()
            progress = Progress(engine.trainer, self.steps, self.samples, self.last_loss, lag, unit)
            engine.on_progress(progress)

    def finish(self) -> Gradients:
        """The trainer's, once ``loop_fn`` has returned: wait for a call still under way;
        returns the gradients the last call must push."""
        if self._in_flight is not None:
            self._in_flight.wait()  # a prefetch whose step never came
            self._in_flight = None
        self._apply_dense()
        if self._forwards:
            log.warning(
                "trainer %d: the loop ran a training forward after its last ctx.step(); "
                "its gradients are not pushed",
                self._engine.trainer,
            )
        return self._pending

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
        if self._pulled is None:
            self._begin_step(Step([call], *replica.record([call])), self._record_next)
        self._forwards += 1
        if self._batch is None:
            self._batch = call
        return replica.forward_fetching(call, client.pull)


def _batch_size(batch: Any) -> int:
    """The first dimension of the first tensor in ``batch`` (1 for a batch without one)."""
    return next(_sizes(batch), 1)


def _sizes(item: Any) -> Iterator[int]:
    if isinstance(item, Tensor):
        yield int(item.shape[0]) if item.dim() else 1
    elif isinstance(item, Call):
        yield from _sizes((item.args, item.kwargs))
    elif isinstance(item, dict):
        yield from _sizes(list(item.values()))
    elif isinstance(item, tuple | list):
        for part in item:
            yield from _sizes(part)
