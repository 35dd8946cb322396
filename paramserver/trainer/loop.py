"""A trainer's part of a job: build the replica and client, resume, run the loop, leave.

``loop_fn(ctx)`` (:mod:`paramserver.trainer.context`) does the steps; :func:`default_loop` is
``paramserver.train``'s: each step takes ``accumulate`` batches, runs forward and backward on
each (the loss divided by the batch count, so the push carries the mean gradient) and steps.
After the loop, a last call pushes the final gradients and leaves the job.

The chief (trainer 0) then waits for every trainer to leave and gathers the final parameters
and every server's statistics, so the job's result is complete under any launcher.

With a checkpoint directory each trainer stages its end (its steps, samples and RNG states
where its loop ended) before its last call, and the chief writes the ends into the job's final
checkpoint (:mod:`paramserver.checkpoint.resume`). A resume from it with a larger budget
(more data, ``--epochs`` or ``--steps``) trains on: each trainer skips the batches it had
trained, restores its RNG states and repeats the final call as a read, so a sync job ends
bitwise where one given that budget from the start ends.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from paramserver.checkpoint import Checkpoint, resume_from, saved_dense
from paramserver.checkpoint.resume import discard_trainer_ends, stage_trainer_end, trainer_ends
from paramserver.config import TrainConfig
from paramserver.errors import CheckpointError, TrainerGroupError
from paramserver.futures import wait_all
from paramserver.inputs import PositionedInput
from paramserver.metrics import Evaluation
from paramserver.modelplan import SEEDING, build_model, plan_of
from paramserver.observe import peak_rss_bytes, startup
from paramserver.observe.summary import summarize
from paramserver.trainer.checkpointing import RngState, TrainerCheckpoints, rng_state
from paramserver.trainer.client import PSClient, PushCodecs, gather_state, to_state_dict
from paramserver.trainer.context import Resumed, TrainContext
from paramserver.trainer.dense import AllReducedDense
from paramserver.trainer.heartbeat import Activity, Heartbeats
from paramserver.trainer.observer import Observer
from paramserver.trainer.replica import Replica
from paramserver.trainer.stages import Engine, Gradients
from paramserver.transport.base import Transport
from paramserver.transport.group import TrainerGroup
from paramserver.transport.profiled import ProfiledTransport
from paramserver.transport.stub import ServerStub
from paramserver.types import Batch, DataFn, LoopFn, LossFn, ModelFn, Progress, as_tuple
from paramserver.wire.reports import TrainerReport

log = logging.getLogger(__name__)


@dataclass
class TrainerOutcome:
    report: TrainerReport
    state: dict[str, Tensor] | None = None  # chief only: final parameters and its buffers
    server_stats: list[dict[str, Any]] | None = None  # chief only
    graceful: bool = True  # whether the RPC world can shut down together (no one departed)
    evals: list[dict[str, float]] = field(default_factory=list)  # chief only: held-out metrics
    value: Any = None  # chief only: what loop_fn returned

    def summary(self, config: TrainConfig, wall_s: float) -> dict[str, Any]:
        """The chief's job summary (:func:`~paramserver.observe.summary.summarize`)."""
        assert self.server_stats is not None, "only the chief gathers the servers' statistics"
        return summarize(self.server_stats, self.report, self.evals, config, wall_s)


def trainer_model(model_fn: ModelFn, seed: int) -> nn.Module:
    """A trainer's model: :func:`~paramserver.modelplan.build_model`'s, with the weights of its
    ``nn.Embedding(Bag)`` tables on the meta device (a trainer never holds a table whole)
    unless ``model_fn`` needs their values. Dense values come with the first pull, buffers from
    :meth:`Replica.load_buffers`."""
    return build_model(model_fn, seed, table_values=False).model


class Epochs:
    """``data_fn(trainer, num_trainers)``'s batches over ``epochs`` passes, counting the bytes
    of input each pass read where it counts them (see :mod:`paramserver.types`)."""

    def __init__(
        self, data_fn: DataFn, trainer: int, num_trainers: int, epochs: int, first: Iterable[Batch]
    ):
        """``first``: the first pass's batches, opened already."""
        self.data_fn, self.trainer, self.num_trainers = data_fn, trainer, num_trainers
        self.epochs = epochs
        self.opened: list[Iterable[Batch]] = [first]

    def __iter__(self) -> Iterator[Batch]:
        for epoch in range(self.epochs):
            if epoch:
                self.opened.append(self.data_fn(self.trainer, self.num_trainers))
            yield from self.opened[-1]

    @property
    def input_bytes(self) -> int | None:
        return input_bytes_read(self.opened)


def default_loop(data_fn: DataFn, loss_fn: LossFn, epochs: int) -> LoopFn:
    """``paramserver.train``'s loop: every batch of ``data_fn``'s over ``epochs`` passes, the
    loss divided by ``accumulate`` so that a step pushes the mean gradient."""

    def loop(ctx: TrainContext) -> None:
        share = ctx.config.accumulate
        first = data_fn(ctx.rank, ctx.num_trainers)
        data: Iterable[Batch] = (
            first  # a stream: read once, from where it was
            if isinstance(first, PositionedInput)
            else Epochs(data_fn, ctx.rank, ctx.num_trainers, epochs, first)
        )
        for inputs, target in ctx.batches(data):
            loss = loss_fn(ctx.model(*as_tuple(inputs)), target)
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
            (loss / share).backward()
            ctx.step(loss.detach() / share, samples=int(target.shape[0]) if target.dim() else 1)

    return loop


def input_bytes_read(opened: Sequence[Iterable[Any]]) -> int | None:
    """The bytes of input the iterables read, if each counts them (an int ``input_bytes``
    attribute, see :mod:`paramserver.types`); None otherwise."""
    counts = [getattr(epoch, "input_bytes", None) for epoch in opened]
    counted = [count for count in counts if isinstance(count, int)]
    return sum(counted) if counted and len(counted) == len(counts) else None


def run_trainer(
    trainer: int,
    config: TrainConfig,
    model_fn: ModelFn,
    loop_fn: LoopFn,
    transport: Transport,
    on_progress: Callable[[Progress], None] | None = None,
    evaluation: Evaluation | None = None,
    on_alarm: Callable[[BaseException], None] | None = None,
    group: TrainerGroup | None = None,
) -> TrainerOutcome:
    """Run ``loop_fn`` until it returns; the chief then gathers the job's results.
    ``on_alarm`` hears (from the heartbeat thread) of a lost server or of this trainer's
    departure, even while the loop is blocked in its data. ``group``: the trainers' group,
    for ``--dense-sync allreduce``."""
    startup.mark("interpreter")  # already marked where the process joined an RPC world
    startup.mark("rendezvous")
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
        run = _TrainerRun(trainer, config, model_fn, transport, heartbeats, group)
        return run.run(loop_fn, on_progress, evaluation)
    finally:
        heartbeats.stop()


class _TrainerRun:
    """One trainer's part of a job: its replica and client, the loop, and the end of the job
    (the chief gathers the results)."""

    def __init__(
        self,
        trainer: int,
        config: TrainConfig,
        model_fn: ModelFn,
        transport: ProfiledTransport,
        heartbeats: Heartbeats,
        group: TrainerGroup | None = None,
    ):
        self.trainer = trainer
        self.config = config
        self.transport = transport
        self.activity = heartbeats.activity
        self.alarm = heartbeats.alarm
        model = trainer_model(model_fn, config.seed)
        self.plan = plan_of(model, config.servers, config.dense_on_servers)
        config.check_tables(self.plan.tables)
        self.replica = Replica(model, config.server_pooling)
        self.replica.model.train()
        with SEEDING:  # not while another trainer thread builds its model
            torch.manual_seed(config.seed * 1_000_003 + 1 + trainer)
        self.client = PSClient(
            transport,
            self.plan,
            trainer,
            self.alarm,
            PushCodecs.of(config.sections.codecs, self.plan.tables),
            cache_rows=config.cache_rows,
            publish_every=_rounds_marked_every(config, trainer),
        )
        self.client.check_servers()
        self._take_servers_buffers(transport)
        self.checkpoints = TrainerCheckpoints(
            config.sections.checkpoint, config.checkpoint_job, trainer, transport, self.alarm
        )
        self.dense = None
        if not config.dense_on_servers:
            if group is None:
                raise ValueError("--dense-sync allreduce needs the trainers' group")
            rule = config.dense_optimizer()
            self.dense = AllReducedDense(
                self.replica.dense, rule, group, self.activity, transport.profile
            )
            if trainer == 0:
                saved = functools.partial(self.dense.saved, self.plan.signature, config.servers)
                self.checkpoints.dense_part = saved
        startup.mark("model")

    def _take_servers_buffers(self, transport: Transport) -> None:
        """Start from the servers' buffers (the chief's as last pushed: a resume continues
        them); the chief then pushes its own, which are the model's (DDP's convention)."""
        buffers: dict[str, Tensor] = {}
        for held in wait_all(ServerStub(transport).initial_buffers(), self.alarm):
            buffers.update(held)  # type: ignore[call-overload]
        self.replica.load_buffers(buffers)
        if self.trainer == 0:
            self.client.send_buffers(dict(self.replica.model.named_buffers()))

    def run(
        self,
        loop_fn: LoopFn,
        on_progress: Callable[[Progress], None] | None,
        evaluation: Evaluation | None,
    ) -> TrainerOutcome:
        resumed = Resumed()
        if self.config.resume:
            resumed = resume_trainer(
                self.trainer, self.config, self.client, self.checkpoints, self.dense
            )
        config = self.config
        observer = Observer(
            self.trainer, config.sections.observe, self.client, self.replica, evaluation,
            self.alarm, resumed.steps, resumed.samples,
            learning_rates=config.learning_rates, one_process=config.launcher == "threads",
        )  # fmt: skip
        engine = Engine(
            self.trainer, self.config, self.replica, self.client, self.checkpoints,
            self.activity, observer, on_progress, self.dense,
        )  # fmt: skip
        ctx = TrainContext(engine, resumed)
        try:
            value, grads, train_seconds, end_rng = self._loop(ctx, loop_fn, resumed)
        except BaseException:
            observer.close()  # its logs and profiler, whatever ended the steps
            raise
        report = self._report(ctx, resumed, observer, train_seconds)
        self._stage_end(ctx, end_rng)  # before the call whose report tells the chief of it
        grads.push(self.client, None, final=True, report=report).wait()
        if self.dense is not None:  # out of the servers' rounds: the others may go on
            self.dense.drain()
        self.checkpoints.finish()
        outcome = self.end_job(report, observer.evals)
        outcome.value = value if self.trainer == 0 else None
        return outcome

    def _report(
        self, ctx: TrainContext, resumed: Resumed, observer: Observer, train_seconds: float
    ) -> TrainerReport:
        """This run's work: from the start, or from the checkpoint it resumed from."""
        steps = ctx.steps - resumed.steps
        return TrainerReport(
            trainer=self.trainer,
            steps=steps,
            samples=ctx.samples - resumed.samples,
            train_loss=ctx.loss_sum / steps if steps else float("nan"),  # every step's mean
            train_seconds=train_seconds,
            bytes_sent=0,
            bytes_received=0,
            peak_rss_bytes=peak_rss_bytes(),
            input_bytes=input_bytes_read(ctx.opened),
            calls=self.transport.profile.snapshot(),
            consistency=observer.finish(ctx.steps, ctx.samples),
            resumed_at=resumed.at,
            resumed_steps=resumed.steps,
            resumed_samples=resumed.samples,
            input_position=None if ctx.position is None else json.dumps(ctx.position),
        )

    def _loop(
        self, ctx: TrainContext, loop_fn: LoopFn, resumed: Resumed
    ) -> tuple[Any, Gradients, float, RngState | None]:
        """Run ``loop_fn(ctx)``: its value, the gradients left to push, its seconds and the
        RNG states it ended with (the next step's, had there been one). A trainer that had
        left the job before the checkpoint it resumed from does not run it (None: where it
        ended is unknown)."""
        started = time.perf_counter()
        self.activity.start()  # from here on, the servers hear how long it is idle
        if resumed.left:
            log.info("trainer %d had left the job before its checkpoint", self.trainer)
            return None, ctx.finish(), 0.0, None
        try:
            value = loop_fn(ctx)
            end_rng = rng_state()
            grads = ctx.finish()
        except TrainerGroupError as error:
            raise self._naming_the_departed(error) from None
        finally:
            ctx.close()
        return value, grads, time.perf_counter() - started, end_rng

    def _stage_end(self, ctx: TrainContext, rng: RngState | None) -> None:
        """Stage where this trainer ended for the job's final checkpoint (see the module
        doc): not one that did not run its loop, nor one that read a stream (the final
        checkpoint's ``stream_ends`` say where that one ended)."""
        root = self.config.checkpoint_dir
        streamed = any(isinstance(opened, PositionedInput) for opened in ctx.opened)
        if root is None or rng is None or streamed:
            return
        tensors, meta = rng
        meta = {**meta, "steps_done": ctx.steps, "samples": ctx.samples}
        stage_trainer_end(root, self.trainer, tensors, meta)

    def _naming_the_departed(self, error: TrainerGroupError) -> TrainerGroupError:
        """The all-reduce failed: name the trainers the servers found silent or stuck (a
        frozen one stops answering its heartbeats before the group times out)."""
        try:
            answers = wait_all(ServerStub(self.transport).departed(), self.alarm)
        except Exception:  # the servers' answer only adds to the message
            return error
        departed = sorted({t for answer in answers for t in answer})  # type: ignore[attr-defined]
        if not departed:
            return error
        names = ", ".join(f"trainer{t}" for t in departed)
        return TrainerGroupError(f"{names} departed (the servers' verdict); {error}")

    def _save_final(self, report: TrainerReport, root: str) -> None:
        """Chief, once every trainer has left: the job's final checkpoint, at its last step:
        the most any trainer did, counting the steps before its resume (from the trainers'
        reports server 0 holds), with where each trainer ended: a stream's position (its
        ``stream_ends``) or the end it staged. Not saved again where a resume trained no
        more (see :meth:`TrainerCheckpoints.save_final`)."""
        stats: Any = wait_all(ServerStub(self.transport).stats()[:1], self.alarm)[0]
        reports: dict[int, TrainerReport] = stats["reports"]
        done = {
            t: (r.steps + r.resumed_steps, r.samples + r.resumed_samples)
            for t, r in reports.items()
        }
        stream_ends = {
            str(t): {
                "steps_done": done[t][0],
                "samples": done[t][1],
                "input_position": json.loads(r.input_position),
            }
            for t, r in reports.items()
            if r.input_position is not None
        }
        step = max(
            (steps for steps, _ in done.values()), default=report.steps + report.resumed_steps
        )
        trained = any(r.steps for r in reports.values()) or report.steps > 0
        staged = functools.partial(trainer_ends, root, expected=done)
        try:
            self.checkpoints.save_final(step, trained, stream_ends, trainer_parts=staged)
        finally:
            discard_trainer_ends(root)

    def end_job(self, report: TrainerReport, evals: list[dict[str, float]]) -> TrainerOutcome:
        """Wait for every other trainer to leave (or be declared departed: the alarm bounds
        the wait); the chief then gathers the final state and every server's statistics."""
        transport, alarm = self.transport, self.alarm
        servers = ServerStub(transport)
        wait_all(servers.wait_all_left(), alarm)
        if self.trainer != 0:
            # The same decision as the chief's below: has any server declared anyone departed?
            departed = wait_all(servers.departed(), alarm)
            return TrainerOutcome(report, graceful=not any(departed))
        if self.config.checkpoint_dir is not None:
            self._save_final(report, self.config.checkpoint_dir)
        state: dict[str, Tensor] = {}
        if self.config.gather_model:
            state = to_state_dict(gather_state(transport, self.plan), self.plan)
            if self.dense is not None:  # kept here, not on the servers
                state.update({n: p.detach().clone() for n, p in self.replica.dense.items()})
            # The servers hold the persistent buffers (the chief's, sent with its final push);
            # anything else of the state_dict the replica has is this replica's.
            kept = self.replica.model.state_dict().items()
            state.update({k: v for k, v in kept if k not in self.replica.dense and k not in state})
        stats: list[dict[str, Any]] = wait_all(  # type: ignore[assignment]
            servers.stats(), alarm
        )
        # A departed trainer's process may be gone: the RPC world cannot shut down together.
        graceful = not any(s["departed"] for s in stats)
        for call in servers.finish_job(graceful):
            with contextlib.suppress(RuntimeError):  # a server leaving alone may not answer
                call.wait()
        return TrainerOutcome(report, state, stats, graceful, evals)


def resume_trainer(
    trainer: int,
    config: TrainConfig,
    client: PSClient,
    checkpoints: TrainerCheckpoints,
    dense: AllReducedDense | None = None,
) -> Resumed:
    """Continue from the newest checkpoint: the call numbering, where this trainer's data and
    RNG states were, and the dense state it keeps under ``--dense-sync allreduce`` (a fresh
    start without a checkpoint). A trainer without a part there had left the job before it
    was saved."""
    found = resume_from(config)
    if found is None:
        return Resumed()
    if dense is not None:
        dense.restore(saved_dense(found))
    # Servers resume with every trainer at the saved call k, holding what each one's call k
    # read: a trainer saved at k (all, in sync mode) repeats it, read again without being
    # counted twice; one saved later (async) goes on at k + 1; one whose data had ended
    # repeats k as its final call.
    saved_at = found.step  # a checkpoint's step is the call number it was saved at
    client.next_call = saved_at
    checkpoints.resumed_at(saved_at)
    if found.meta.get("trainers") != config.trainers:  # async or SSP (see resume_problem)
        return _split_anew(found, trainer, config.trainers)
    name = f"trainer-{trainer}"
    if name not in found.part_names:
        end = found.meta.get("stream_ends", {}).get(str(trainer))
        if end is not None:  # a stream job's final checkpoint: it goes on where it ended
            # Its call k was its last, a push that read nothing: never one to repeat.
            client.next_call = saved_at + 1
            steps, samples = int(end["steps_done"]), int(end["samples"])
            return Resumed(saved_at, steps, samples, position=end["input_position"])
        return Resumed(saved_at, left=True)
    tensors, meta = found.read_part(name)
    steps_done = int(meta["steps_done"])
    # Its training steps ran past call k: it goes on at k + 1. Not from a final checkpoint,
    # whose trainers had pushed every step they trained: each repeats call k as a read.
    if steps_done != saved_at and not found.meta.get("final"):
        client.next_call = saved_at + 1
    # Restored once the loop's data is replayed: it may draw from the same RNGs.
    position = meta.get("input_position")
    return Resumed(saved_at, steps_done, int(meta["samples"]), (tensors, meta), position=position)


def _split_anew(found: Checkpoint, trainer: int, trainers: int) -> Resumed:
    """Where ``trainer`` starts when the job resumes on another trainer count than saved
    ``found``: the data is split anew, so no saved position is its own. The steps the saved
    trainers had done in all are shared out as evenly as they go, and each trainer skips that
    many steps of its new share (so the job trains on about as many batches in all as it
    would have; which ones each skipped is not what the old trainers trained on); it repeats
    call k first (a read), and its RNG states start afresh. A final checkpoint without the
    trainers' ends (saved by an older version) says nothing of where they were: every
    trainer leaves at once."""
    saved = [found.read_part(n)[1] for n in found.part_names if n.startswith("trainer-")]
    if found.meta.get("stream_ends") or any("input_position" in meta for meta in saved):
        raise CheckpointError(
            f"--resume: {found.directory} was saved by a job of {found.meta.get('trainers')} "
            f"trainers reading a stream; resume it with as many: each trainer's saved stream "
            f"position is its own consumer's, which another split cannot continue"
        )
    if found.meta.get("final") and not saved:
        return Resumed(found.step, left=True)
    steps = sum(int(meta["steps_done"]) for meta in saved)
    samples = sum(int(meta["samples"]) for meta in saved)
    share = steps // trainers + (1 if trainer < steps % trainers else 0)
    return Resumed(found.step, share, samples * share // steps if steps else 0)


def _rounds_marked_every(config: TrainConfig, trainer: int) -> float | None:
    """How often this trainer marks its call's round for the servers' change logs: the chief
    of a sync job that publishes (other jobs' servers cut on their own timers)."""
    publishes = config.publish_dir is not None and config.mode == "sync"
    return config.publish_every if publishes and trainer == 0 else None
