"""A trainer's training loop.

One step: take ``accumulate`` batches; record the ids they touch; one fused call per server
pushes the previous step's gradients and pulls the rows and dense values this step needs; run
forward and backward on each batch (the loss divided by the batch count, so the push carries
the mean gradient); clip by global norm if asked. After the data ends, a last call pushes the
final gradients and leaves the job.

Prefetch (async, and ssp with a bound of at least 1): the call that pushes step ``t-1``'s
gradients already pulls the rows of step ``t+1``, and is under way while step ``t`` computes,
so the servers' work and the wire overlap the trainer's compute. Rows then miss this trainer's
own latest push (one step of staleness, which async mode allows and ssp counts in its bound).
One call per trainer is in flight at a time, so a server sees a trainer's pushes in order.
Sync mode never prefetches: its rounds promise values that include every trainer's previous
step.

The chief (trainer 0) then waits for every trainer to leave and gathers the final parameters
and every server's statistics, so the job's result is complete under any launcher.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from paramserver.checkpoint import resume_from
from paramserver.config import TrainConfig
from paramserver.futures import wait_all
from paramserver.metrics import Evaluation
from paramserver.modelplan import build_model, plan_of
from paramserver.observe import peak_rss_bytes
from paramserver.protocol import BagBlock, TrainerReport
from paramserver.trainer.checkpointing import TrainerCheckpoints, set_rng_state
from paramserver.trainer.client import (
    InFlight,
    PSClient,
    Pulled,
    PushCodecs,
    gather_state,
    to_state_dict,
)
from paramserver.trainer.heartbeat import Activity, Heartbeats
from paramserver.trainer.observer import Observer
from paramserver.trainer.replica import Replica
from paramserver.transport.base import Transport
from paramserver.transport.profiled import ProfiledTransport
from paramserver.types import Batch, DataFn, Inputs, LossFn, ModelFn, Progress

log = logging.getLogger(__name__)


@dataclass
class Step:
    """One step's batches and what they look up (recorded ahead of the step's pull)."""

    batches: list[Batch]
    ids: dict[str, Tensor]
    bags: dict[str, BagBlock]


@dataclass
class Gradients:
    """A step's gradients, waiting to ride on the next call."""

    dense: dict[str, Tensor] = field(default_factory=dict)
    rows: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    pooled: dict[str, tuple[int, Tensor]] = field(default_factory=dict)
    pull_call: int = -1  # the call whose answer they were computed from

    @classmethod
    def of(cls, replica: Replica, pull_call: int) -> Gradients:
        dense, rows = replica.gradients()
        pooled = {name: (pull_call, g) for name, g in replica.pooled_gradients().items()}
        return cls(dense, rows, pooled, pull_call)

    def push(
        self,
        client: PSClient,
        following: Step | None,
        final: bool = False,
        report: TrainerReport | None = None,
    ) -> InFlight:
        """Send these gradients, pulling what ``following`` needs; they are then spent."""
        in_flight = client.push_pull(
            self.dense,
            self.rows,
            following.ids if following else {},
            pool_bags=following.bags if following else {},
            pooled_grads=self.pooled,
            pull_dense=following is not None,
            final=final,
            report=report,
            grads_call=self.pull_call,
        )
        self.dense, self.rows, self.pooled, self.pull_call = {}, {}, {}, -1
        return in_flight


@dataclass
class TrainerOutcome:
    report: TrainerReport
    state: dict[str, Tensor] | None = None  # chief only: final parameters and its buffers
    server_stats: list[dict[str, Any]] | None = None  # chief only
    graceful: bool = True  # whether the RPC world can shut down together (no one departed)
    evals: list[dict[str, float]] = field(default_factory=list)  # chief only: held-out metrics


def trainer_model(model_fn: ModelFn, seed: int) -> nn.Module:
    """A trainer's model: :func:`~paramserver.modelplan.build_model`'s, with the weights of its
    ``nn.Embedding(Bag)`` tables on the meta device (a trainer never holds a table whole)
    unless ``model_fn`` needs their values. Dense values come with the first pull, buffers from
    :meth:`Replica.load_buffers`."""
    return build_model(model_fn, seed, table_values=False).model


def step_groups(
    data_fn: DataFn,
    trainer: int,
    num_trainers: int,
    config: TrainConfig,
    opened: list[Iterable[Batch]] | None = None,
) -> Iterator[list[Batch]]:
    """This trainer's batches, ``accumulate`` at a time, over ``epochs``, at most ``steps``;
    each epoch's iterable is appended to ``opened`` (for :func:`input_bytes_read`)."""
    group: list[Batch] = []
    produced = 0
    for _ in range(config.epochs):
        epoch = data_fn(trainer, num_trainers)
        if opened is not None:
            opened.append(epoch)
        for batch in epoch:
            group.append(batch)
            if len(group) == config.accumulate:
                yield group
                group = []
                produced += 1
                if config.steps is not None and produced >= config.steps:
                    return
    if group:
        yield group


def input_bytes_read(opened: Sequence[Iterable[Batch]]) -> int | None:
    """The bytes of input the iterables read, if each counts them (an int ``input_bytes``
    attribute, see :mod:`paramserver.types`); None otherwise."""
    counts = [getattr(epoch, "input_bytes", None) for epoch in opened]
    counted = [count for count in counts if isinstance(count, int)]
    return sum(counted) if counted and len(counted) == len(counts) else None


def run_trainer(
    trainer: int,
    config: TrainConfig,
    model_fn: ModelFn,
    data_fn: DataFn,
    loss_fn: LossFn,
    transport: Transport,
    on_progress: Callable[[Progress], None] | None = None,
    evaluation: Evaluation | None = None,
    on_alarm: Callable[[BaseException], None] | None = None,
) -> TrainerOutcome:
    """Train until this trainer's data ends; the chief then gathers the job's results.
    ``on_alarm`` hears (from the heartbeat thread) of a lost server or of this trainer's
    departure, even while the loop is blocked in its data."""
    activity = Activity()
    # Every call's latency and bytes, by operation; every call is progress.
    transport = ProfiledTransport(transport, activity=activity)
    # Heartbeats first: model building can take a while, and the servers count silence. A
    # server may take as long to answer one as servers wait for a silent trainer (a busy one,
    # exporting a large shard say, can take seconds; a dead one fails at once).
    heartbeats = Heartbeats(
        transport,
        trainer,
        config.heartbeat_interval,
        config.trainer_timeout,
        activity,
        on_alarm,
    ).start()
    try:
        return _train(
            trainer,
            config,
            model_fn,
            data_fn,
            loss_fn,
            transport,
            heartbeats,
            on_progress,
            evaluation,
        )
    finally:
        heartbeats.stop()


def _train(
    trainer: int,
    config: TrainConfig,
    model_fn: ModelFn,
    data_fn: DataFn,
    loss_fn: LossFn,
    transport: ProfiledTransport,
    heartbeats: Heartbeats,
    on_progress: Callable[[Progress], None] | None,
    evaluation: Evaluation | None,
) -> TrainerOutcome:
    run = _TrainerRun(trainer, config, model_fn, transport, heartbeats)
    opened: list[Iterable[Batch]] = []  # each epoch's data, for the bytes it read
    groups = step_groups(data_fn, trainer, config.trainers, config, opened)
    resumed = Resumed()
    if config.resume:
        resumed = resume_trainer(trainer, config, run.client, run.checkpoints, groups)
    run.steps, run.samples = resumed.steps, resumed.samples  # its position in the job
    observer = Observer(
        trainer, config.observing, run.client, run.replica, evaluation, heartbeats.alarm,
        run.steps, run.samples,
    )  # fmt: skip
    try:
        grads, train_seconds = run.train(groups, loss_fn, observer, on_progress)
    except BaseException:
        observer.close()  # its logs and profiler, whatever ended the steps
        raise
    report = TrainerReport(  # this run's work: from the start, or from the checkpoint
        trainer=trainer,
        steps=run.steps - resumed.steps,
        samples=run.samples - resumed.samples,
        train_loss=sum(run.losses) / len(run.losses) if run.losses else float("nan"),
        train_seconds=train_seconds,
        bytes_sent=0,
        bytes_received=0,
        peak_rss_bytes=peak_rss_bytes(),
        input_bytes=input_bytes_read(opened),
        calls=transport.profile.snapshot(),
        consistency=observer.finish(run.steps, run.samples),
        resumed_at=resumed.at,
        resumed_steps=resumed.steps,
        resumed_samples=resumed.samples,
    )
    grads.push(run.client, None, final=True, report=report).wait()
    run.checkpoints.finish()
    return run.end_job(report, observer.evals)


class _TrainerRun:
    """One trainer's part of a job: its replica and client, the step loop, and the end of
    the job (the chief gathers the results)."""

    def __init__(
        self,
        trainer: int,
        config: TrainConfig,
        model_fn: ModelFn,
        transport: ProfiledTransport,
        heartbeats: Heartbeats,
    ):
        self.trainer = trainer
        self.config = config
        self.transport = transport
        self.activity = heartbeats.activity
        self.alarm = heartbeats.alarm
        model = trainer_model(model_fn, config.seed)
        self.plan = plan_of(model, config.servers)
        config.check_tables(self.plan.tables)
        self.replica = Replica(model, config.server_pooling)
        self.replica.model.train()
        torch.manual_seed(config.seed * 1_000_003 + 1 + trainer)
        self.client = PSClient(
            transport,
            self.plan,
            trainer,
            self.alarm,
            PushCodecs.of(config, self.plan.tables),
            cache_rows=config.cache_rows,
        )
        self.client.check_servers()
        initial_buffers = wait_all([transport.call(0, "initial_buffers")], self.alarm)[0]
        self.replica.load_buffers(initial_buffers)  # type: ignore[arg-type]
        self.checkpoints = TrainerCheckpoints(config.checkpointing, trainer, transport, self.alarm)
        self.steps = self.samples = 0
        self.losses: deque[float] = deque(maxlen=100)

    def train(
        self,
        groups: Iterator[list[Batch]],
        loss_fn: LossFn,
        observer: Observer,
        on_progress: Callable[[Progress], None] | None,
    ) -> tuple[Gradients, float]:
        """Every step of this trainer's data; returns the last gradients (not pushed yet)
        and the seconds the steps took."""
        client, prefetch = self.client, self.config.prefetches

        def record_next() -> Step | None:
            group = next(groups, None)
            self.activity.touch()  # a batch drawn: the loop is not stuck in its data
            if group is None:
                return None
            ids, bags = self.replica.record([batch[0] for batch in group])
            return Step(group, ids, bags)

        grads = Gradients()
        started = time.perf_counter()
        self.activity.start()  # from here on, the servers hear how long it is idle
        current = record_next()
        in_flight = (
            client.push_pull({}, {}, current.ids, pool_bags=current.bags) if current else None
        )
        while current is not None:
            assert in_flight is not None
            pulled = in_flight.wait()
            self.checkpoints.after_reply(
                pulled.call, pulled.checkpoint_at, self.steps, self.samples
            )
            following = record_next()
            if following is not None:  # a checkpoint the chief can take: it has a next step
                self.checkpoints.announce_if_due(pulled.call)
            if prefetch:
                # Pull the next step's rows while this one computes, pushing what is ready now.
                in_flight = grads.push(client, following)
            grads = self._compute(current, pulled, loss_fn)
            if not prefetch and following is not None:
                in_flight = grads.push(client, following)
            observer.after_step(self.steps, self.samples, self.losses[-1], pulled)
            if on_progress is not None:
                on_progress(Progress(self.trainer, self.steps, self.samples, self.losses[-1]))
            current = following
        if in_flight is not None:
            in_flight.wait()  # the last prefetch call (a no-op otherwise: waited above)
        return grads, time.perf_counter() - started

    def _compute(self, step: Step, pulled: Pulled, loss_fn: LossFn) -> Gradients:
        """Forward and backward over the step's batches on the pulled values; returns the
        step's gradients and counts the step, its samples and its loss."""
        replica = self.replica
        replica.load(
            pulled.dense,
            pulled.rows,
            {name: (pulled.pooled[name], bags) for name, bags in step.bags.items()},
        )
        step_loss = 0.0
        for batch_inputs, target in step.batches:
            step_loss += _forward_backward(
                replica, self.client, batch_inputs, target, loss_fn, len(step.batches)
            )
            self.samples += int(target.shape[0]) if target.dim() else 1
        if self.config.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(replica.grad_tensors(), self.config.clip_grad_norm)
        self.steps += 1
        self.losses.append(step_loss)
        return Gradients.of(replica, pulled.call)

    def end_job(self, report: TrainerReport, evals: list[dict[str, float]]) -> TrainerOutcome:
        """Wait for every other trainer to leave (or be declared departed: the alarm bounds
        the wait); the chief then gathers the final state and every server's statistics."""
        transport, alarm = self.transport, self.alarm
        wait_all(transport.call_all("wait_all_left", timeout_s=0), alarm)
        if self.trainer != 0:
            # The same decision as the chief's below: has any server declared anyone departed?
            departed = wait_all(transport.call_all("departed"), alarm)
            return TrainerOutcome(report, graceful=not any(departed))
        state: dict[str, Tensor] = {}
        if self.config.gather_model:
            state = to_state_dict(gather_state(transport, self.plan), self.plan)
            # Buffers (batch-norm statistics and the like) are not served: take this replica's.
            buffers = self.replica.model.state_dict().items()
            state.update({k: v for k, v in buffers if k not in self.replica.dense})
        stats: list[dict[str, Any]] = wait_all(  # type: ignore[assignment]
            transport.call_all("stats"), alarm
        )
        # A departed trainer's process may be gone: the RPC world cannot shut down together.
        graceful = not any(s["departed"] for s in stats)
        for call in transport.call_all("finish_job", graceful):
            with contextlib.suppress(RuntimeError):  # a server leaving alone may not answer
                call.wait()
        return TrainerOutcome(report, state, stats, graceful, evals)


@dataclass(frozen=True)
class Resumed:
    """Where a trainer starts: the checkpoint's step, the call number it was saved at (-1:
    none, a fresh start), and the training steps and samples the trainer had done by then (0
    for a trainer that had left the job before it)."""

    at: int = -1
    steps: int = 0
    samples: int = 0


def resume_trainer(
    trainer: int,
    config: TrainConfig,
    client: PSClient,
    checkpoints: TrainerCheckpoints,
    groups: Iterator[list[Batch]],
) -> Resumed:
    """Continue from the newest checkpoint: skip the data this trainer had trained on, then
    restore its RNG states and call numbering; returns where it resumed (a fresh start
    without a checkpoint). A trainer without a part there had left the job before it was
    saved: its data is spent."""
    found = resume_from(config)
    if found is None:
        return Resumed()
    # Servers resume with every trainer at the saved call k, holding what each one's call k
    # read: a trainer saved at k (all, in sync mode) repeats it, read again without being
    # counted twice; one saved later (async) goes on at k + 1; one whose data had ended
    # repeats k as its final call.
    saved_at = found.step  # a checkpoint's step is the call number it was saved at
    client.next_call = saved_at
    checkpoints.resumed_at(saved_at)
    name = f"trainer-{trainer}"
    if name not in found.part_names:
        for _ in groups:
            pass
        return Resumed(saved_at)
    tensors, meta = found.read_part(name)
    steps_done = int(meta["steps_done"])
    if steps_done != saved_at:  # its training steps ran past call k: it goes on at k + 1
        client.next_call = saved_at + 1
    for _ in range(steps_done):
        next(groups, None)
    set_rng_state(tensors, meta)  # after the replay: data_fn may draw from the same RNGs
    return Resumed(saved_at, steps_done, int(meta["samples"]))


def _forward_backward(
    replica: Replica,
    client: PSClient,
    inputs: Inputs,
    target: Tensor,
    loss_fn: LossFn,
    batches_in_step: int,
) -> float:
    output = replica.forward_fetching(inputs, client.pull)
    loss = loss_fn(output, target)
    if loss.dim() != 0:
        raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
    (loss / batches_in_step).backward()
    return float(loss.detach()) / batches_in_step
