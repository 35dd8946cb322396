"""The Python API: ``paramserver.run(model_fn, loop_fn, config)`` runs a training loop of the
user's own on every trainer; ``paramserver.train(model_fn, data_fn, loss_fn, config)`` is
``run`` with a default loop (:func:`paramserver.trainer.loop.default_loop`)."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.utils.data import RandomSampler

from paramserver.changelog.log import published_servers
from paramserver.config import Launcher, TrainConfig
from paramserver.errors import ConfigError, ModelError
from paramserver.inputs import STOP, reads_a_stream
from paramserver.metrics import Evaluation, as_summary
from paramserver.modelplan import build_model, load_job_state
from paramserver.observe import proc_kib
from paramserver.observe.runlog import RunLog, write_summary
from paramserver.observe.summary import nothing_trained
from paramserver.progress import ProgressDisplay
from paramserver.sharding import ShardPlan
from paramserver.types import Batch, DataFn, LoopFn, LossFn, ModelFn, Progress

if TYPE_CHECKING:
    from paramserver.launch.roles import ChiefResult


log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """``model`` is a plain ``nn.Module`` (built by ``model_fn()``) holding the final parameters
    gathered from the servers (None with ``gather_model=False``); ``summary`` is the job summary
    (the ``--summary-json`` object); ``value`` is what ``loop_fn`` returned on the chief trainer
    (:func:`run`; None for :func:`train`)."""

    model: nn.Module | None
    summary: dict[str, Any]
    value: Any = None


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def train(
    model_fn: ModelFn,
    data_fn: DataFn | Iterable[Batch],
    loss_fn: LossFn,
    config: TrainConfig | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    evaluation: Evaluation | None = None,
) -> TrainResult | None:
    """Train ``model_fn()``'s model on ``config.servers`` servers and ``config.trainers`` trainers.

    ``data_fn(trainer, num_trainers)`` yields ``(inputs, target)`` batches for one trainer
    (``inputs`` a tensor or a tuple of tensors passed as ``model(*inputs)``); ``loss_fn(output,
    target)`` returns a scalar. Instead of ``data_fn``, any re-iterable of batches in a fixed
    order (a list, a DataLoader that does not shuffle) will do: trainer ``t`` of ``n`` takes
    batches ``t, t + n, t + 2n, ...`` of each pass over it (each trainer reads the whole
    iterable; shuffle inside a ``data_fn`` to read only a share). The three may be lambdas or
    closures: they are shipped to worker processes with cloudpickle. Every parameter starts
    from one ``model_fn()`` call under ``config.seed``.

    ``evaluation`` (held-out data and a metric function) scores the final model (the summary's
    ``eval_*``) and, with ``config.eval_every``, the chief trainer's replica during training;
    ``summary["eval_history"]`` lists them all by the chief's step.

    Progress: ``on_progress`` is called with each trainer's :class:`Progress` as it goes (in the
    calling process; under torchrun, on each trainer rank); without it, ``config.progress``
    shows a bar on a terminal and otherwise logs a line every ``config.log_every`` seconds.
    ``config.batch_size`` must stay unset (a :class:`ConfigError` otherwise): it sizes the
    batches of ``paramserver train``'s datasets, and here ``data_fn`` makes the batches.

    Returns the result on the process that launched the job (or, under torchrun, on the chief
    trainer); other torchrun ranks get ``None``.
    """
    config = config or TrainConfig()
    if config.batch_size is not None:
        raise ConfigError(
            f"batch_size={config.batch_size}: train() takes the batches data_fn yields as they "
            "are; batch_size sizes paramserver train's datasets only: leave it unset and make "
            "the batches in data_fn"
        )
    from paramserver.trainer.loop import default_loop

    if reads_a_stream(data_fn):  # every trainer is needed (see TrainConfig.stream_input)
        config = config.replace(stream_input=True)
    loop_fn = default_loop(as_data_fn(data_fn), loss_fn, config.epochs)
    return _start(model_fn, loop_fn, config, on_progress, evaluation)


def run(
    model_fn: ModelFn,
    loop_fn: LoopFn,
    config: TrainConfig | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    evaluation: Evaluation | None = None,
) -> TrainResult | None:
    """Run ``loop_fn(ctx)`` on every trainer of a job on ``config.servers`` servers and
    ``config.trainers`` trainers, as :func:`train` runs its own loop (same launchers, result,
    progress and ``evaluation``; ``model_fn`` and ``loop_fn`` are shipped with cloudpickle).

    ``ctx`` (:class:`paramserver.trainer.context.TrainContext`): ``ctx.model`` is the
    trainer's replica of ``model_fn()``'s model (its tables on the servers); ``ctx.rank`` and
    ``ctx.num_trainers`` say which share of the data is this trainer's; ``ctx.batches(iterable)``
    yields batches with each step's rows fetched ahead; after ``loss.backward()``,
    ``ctx.step(loss)`` pushes the gradients as the config says (mode, codecs, clipping,
    ``accumulate``, checkpoints). A forward under ``torch.no_grad()`` reads and changes nothing
    on the servers. ``result.value`` is what ``loop_fn`` returned on the chief trainer.
    ``config.epochs`` must stay 1 (the loop makes its passes) and ``config.batch_size`` unset.
    """
    config = config or TrainConfig()
    for name in ("batch_size", "epochs"):
        if getattr(config, name) != TrainConfig.__dataclass_fields__[name].default:
            raise ConfigError(
                f"{name}={getattr(config, name)}: run() leaves batches and passes over the data "
                f"to loop_fn; leave {name} unset"
            )
    if not callable(loop_fn):
        raise TypeError(f"loop_fn must be a function of ctx, got {type(loop_fn).__name__}")
    return _start(model_fn, loop_fn, config, on_progress, evaluation)


def _start(
    model_fn: ModelFn,
    loop_fn: LoopFn,
    config: TrainConfig,
    on_progress: Callable[[Progress], None] | None,
    evaluation: Evaluation | None,
) -> TrainResult | None:
    _check_job(config, model_fn, evaluation)
    launcher = config.launcher
    if launcher == "auto":
        launcher = "torchrun" if under_torchrun() else "processes"
    display = None
    if on_progress is None and config.progress:
        display = ProgressDisplay(None, log_every_s=config.log_every)
        on_progress = display
    try:
        return _launch(config, launcher, model_fn, loop_fn, on_progress, evaluation)
    finally:
        if display is not None:
            display.close()


def _check_job(config: TrainConfig, model_fn: ModelFn, evaluation: Evaluation | None) -> None:
    """What a job refuses before anything starts, each with a ConfigError saying why."""
    if config.evaluates_while_training and evaluation is None:
        raise ConfigError("eval_every(_s) needs held-out data: pass evaluation=Evaluation(...)")
    if evaluation is not None and next(iter(evaluation.data_fn()), None) is None:
        raise ConfigError("evaluation: the held-out data yielded no batches")
    check_model_fits(model_fn, config)
    _check_publish_dir(config)
    if not config.gather_model and config.checkpoint_dir is None:
        log.warning(
            "--no-gather-model without --checkpoint-dir: the model this job ends with will be "
            "kept nowhere (give --checkpoint-dir: its final checkpoint is written at the end)"
        )


def _check_publish_dir(config: TrainConfig) -> None:
    """A new job publishing over another's change log would tell serving that the other's
    rows are its own: a resumed job continues the chains (see paramserver.changelog.log)."""
    if config.publish_dir is None or config.resume:
        return
    found = published_servers(config.publish_dir)
    if found:
        raise ConfigError(
            f"--publish-dir {config.publish_dir} already holds a change log (servers "
            f"{', '.join(map(str, found))}); publish a new job into a new directory, or "
            f"--resume the job that wrote it"
        )


def _launch(
    config: TrainConfig,
    launcher: Launcher,
    model_fn: ModelFn,
    loop_fn: LoopFn,
    on_progress: Callable[[Progress], None] | None,
    evaluation: Evaluation | None,
) -> TrainResult | None:
    """Run the job with ``launcher`` (never "auto") and build its result."""
    started = time.perf_counter()
    from paramserver.launch.roles import ChiefResult, hold_checkpoint_dir

    # One job per --checkpoint-dir: refused here, before any process starts, if another holds it.
    with hold_checkpoint_dir(config, launcher):
        if launcher == "threads":
            from paramserver.launch.stopping import stops_gracefully
            from paramserver.launch.threads import run_threads

            with stops_gracefully(config.stream_input, STOP.set):
                chief, _ = run_threads(config, model_fn, loop_fn, on_progress, evaluation)
            assert chief.state is not None
            summary = chief.summary(config, time.perf_counter() - started)
            result: ChiefResult | None = ChiefResult(chief.state, summary, chief.value)
        elif launcher == "torchrun":
            from paramserver.launch.torchrun import run_torchrun_rank

            result = run_torchrun_rank(config, model_fn, loop_fn, on_progress, evaluation)
            if result is not None:
                result.summary["wall_s"] = time.perf_counter() - started
        else:
            from paramserver.launch.processes import run_processes

            # Its summary covers every attempt, restarts included (see run_processes).
            result = run_processes(config, model_fn, loop_fn, on_progress, evaluation)
        if result is None:
            return None
        nothing = nothing_trained(result.summary)
        if nothing is not None:
            log.warning("%s", nothing)
        return _result(model_fn, config, result, evaluation)


def check_model_fits(model_fn: ModelFn, config: TrainConfig) -> None:
    """Refuse, before any process starts, what every trainer would refuse at its start: tables
    the config names (per-table settings, ``server_pooling``) that the model lacks, and tables
    the servers cannot pool (not a sum or mean bag). Builds the model as a trainer does, its
    tables on the meta device."""
    from paramserver.modelplan import plan_of
    from paramserver.trainer.loop import trainer_model
    from paramserver.trainer.replica import Replica

    model = trainer_model(model_fn, config.seed)
    plan = plan_of(model, config.servers, config.dense_on_servers)
    config.check_tables(plan.tables)
    check_gather_fits(plan, config)
    replica = Replica(model)  # ModelError for a layer no server can hold (max_norm, tied)
    for table in config.server_pooling:
        try:
            replica.tables[table].pool_on_servers()
        except ModelError as error:
            raise ConfigError(f"--server-pooling {table}: {error}") from None


GATHER_MEMORY_SHARE = 0.5
"""``gather_model`` is refused for a model whose parameters exceed this share of the memory
available: the gathering process holds the pieces it receives and the assembled copy at once."""


def check_gather_fits(plan: ShardPlan, config: TrainConfig) -> None:
    """Refuse ``gather_model`` for a model too large to gather into one process, before any
    process starts: when its fixed tables and dense parameters take more than
    :data:`GATHER_MEMORY_SHARE` of :func:`available_memory`. Dynamic tables are not counted
    (they grow with the data)."""
    if not config.gather_model:
        return
    needed = sum(spec.nbytes for spec in plan.dense.values()) + sum(
        t.num_rows * t.dim * t.dtype.itemsize for t in plan.tables.values() if t.dynamic is None
    )
    available = available_memory()
    if needed > GATHER_MEMORY_SHARE * available:
        raise ConfigError(
            f"gather_model: the model's parameters take {needed / 2**30:.1f} GiB, more than "
            f"{GATHER_MEMORY_SHARE:.0%} of the {available / 2**30:.1f} GiB of memory available "
            "to gather them into one process: pass gather_model=False (--no-gather-model), "
            "save checkpoints with --checkpoint-dir, and write a checkpoint's model with "
            "`paramserver export CHECKPOINT_DIR model.pt` (it holds one table shard at a time)"
        )


def available_memory() -> int:
    """Bytes of memory available on this host now: ``MemAvailable`` in ``/proc/meminfo``, or the
    physical memory where that is unknown."""
    available = proc_kib("/proc/meminfo", "MemAvailable")
    if available is not None:
        return available * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def as_data_fn(data: DataFn | Iterable[Batch]) -> DataFn:
    """``data`` as a function of (trainer, num_trainers): itself, or a round-robin share of a
    re-iterable of batches."""
    if callable(data):
        return data
    if not isinstance(data, Iterable):
        raise TypeError(
            f"data must be a function (trainer, num_trainers) -> batches or an iterable of "
            f"batches, got {type(data).__name__}"
        )
    if isinstance(data, Iterator):
        raise TypeError(
            "data is a one-pass iterator (a generator, say): trainers need to read it "
            "independently, every epoch; pass a list, a DataLoader or a function "
            "(trainer, num_trainers) -> batches"
        )
    if isinstance(getattr(data, "sampler", None), RandomSampler):
        raise TypeError(
            "data is a DataLoader that shuffles: each trainer would draw its own order and "
            "their shares would overlap; pass a function (trainer, num_trainers) -> batches "
            "that shuffles (a DistributedSampler(dataset, num_trainers, trainer) say)"
        )
    iterable = data

    def shard(trainer: int, num_trainers: int) -> Iterator[Batch]:
        return itertools.islice(iterable, trainer, None, num_trainers)

    return shard


def _result(
    model_fn: ModelFn,
    config: TrainConfig,
    result: ChiefResult,
    evaluation: Evaluation | None,
) -> TrainResult:
    model = None
    if config.gather_model:
        model = build_model(model_fn, config.seed, table_values=False).model
        load_job_state(model, result.state)  # the tables' meta weights take it
        if evaluation is not None:
            _evaluate_final(model, evaluation, config, result.summary)
    if config.run_dir is not None:
        write_summary(config.run_dir, result.summary)
    return TrainResult(model, result.summary, result.value)


def _evaluate_final(
    model: nn.Module, evaluation: Evaluation, config: TrainConfig, summary: dict[str, Any]
) -> None:
    """The final model's held-out metrics: ``eval_*`` in the summary, the last entry of its
    ``eval_history`` (at the chief's last step) and of the chief's records in the run dir."""
    metrics = evaluation.score(model)
    summary.update(as_summary(metrics))
    # The chief's step in the job: the summary counts this run's, from where it resumed.
    resumed = summary["resumed_from"]["trainer_steps"][0] if summary["resumed_from"] else 0
    step = resumed + summary["trainer_steps"][0] if summary["trainer_steps"] else 0
    summary["eval_history"].append({"step": step, **metrics})
    if config.run_dir is not None:
        run_log = RunLog(config.run_dir, "trainer-0", config.tensorboard)
        run_log.write("eval", step, metrics)
        run_log.close()
