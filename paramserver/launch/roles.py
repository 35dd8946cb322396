"""What each role does, independent of how it was launched, and the job summary."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from paramserver.checkpoint import (
    DENSE_PART,
    Saved,
    check_fresh_start,
    lock_directory,
    resume_from,
)
from paramserver.config import TrainConfig
from paramserver.errors import CheckpointError, JobFailedError, TrainerDepartedError
from paramserver.metrics import Evaluation
from paramserver.modelplan import build_model, plan_of
from paramserver.observe import startup
from paramserver.observe.consistency import merge_checks
from paramserver.protocol import CallStats, TrainerReport
from paramserver.server.coordinator import Coordinator
from paramserver.server.endpoint import ServerEndpoint
from paramserver.server.shard import ServerShard
from paramserver.server.snapshot import model_signature, restore_shard
from paramserver.trainer.loop import TrainerOutcome, run_trainer
from paramserver.transport.group import CollectiveGroup, TrainerGroup
from paramserver.types import LoopFn, ModelFn, Progress

log = logging.getLogger(__name__)

LEAVE_ALONE_DELAY_S = 0.5


@dataclass
class ChiefResult:
    """What a job gives back on the chief trainer: the final parameters (empty without
    ``gather_model``), the summary, and what ``loop_fn`` returned."""

    state: dict[str, Tensor]
    summary: dict[str, Any]
    value: Any = None


def build_server(server: int, config: TrainConfig, model_fn: ModelFn) -> ServerEndpoint:
    """Server ``server``'s endpoint, holding its shard of one seeded ``model_fn()``: the dense
    parameters placed on it and its own rows of each table (the model's tables are never built
    whole, see :func:`~paramserver.modelplan.build_model`). Server 0 keeps the buffers, which
    trainers fetch from it at their start."""
    built = build_model(model_fn, config.seed)
    plan = plan_of(built.model, config.servers, config.dense_on_servers)
    config.check_tables(plan.tables)
    dense = {n: p for n, p in built.model.named_parameters() if n in plan.dense_server}
    settings = config.shard_settings(plan.tables)
    shard = ServerShard(server, plan, dense, built.inits, settings)
    buffers = {n: b.detach().clone() for n, b in built.model.named_buffers()} if server == 0 else {}
    del built, dense
    coordinator = Coordinator(shard, config.consistency)
    if config.resume:
        resume_server(shard, coordinator, config)
    return ServerEndpoint(coordinator, buffers)


def resume_server(shard: ServerShard, coordinator: Coordinator, config: TrainConfig) -> None:
    """Load this server's part of the newest valid checkpoint (saved with any server count):
    its own saved part where the server count is the same, else its rows of every part, one
    part at a time."""
    found = resume_from(config)
    if found is None:
        return
    names = [n for n in found.part_names if n.startswith("server-")]
    if found.meta.get("servers") == config.servers:  # the same layout: its own part has its rows
        names = [f"server-{shard.server}"]
    if DENSE_PART in found.part_names:  # saved under --dense-sync allreduce
        names.append(DENSE_PART)
    signature = model_signature(shard)

    def saved() -> Iterator[Saved]:
        for name in names:
            tensors, meta = found.read_part(name)
            if meta.get("signature") != signature:
                raise CheckpointError(
                    f"{found.directory}: {name} was saved from a different model "
                    "(other parameters, tables or shapes)"
                )
            yield tensors, meta

    restore_shard(shard, saved())
    coordinator.resume_at(found.step)
    log.info("server %d resumed from %s", shard.server, found.directory)


def hold_checkpoint_dir(
    config: TrainConfig, launcher: str
) -> contextlib.AbstractContextManager[object]:
    """The lock on ``--checkpoint-dir`` (see :mod:`paramserver.checkpoint.lock`), taken now, for
    the job to hold until it ends: by the launching process under the threads and processes
    launchers (so ``--max-restarts`` keeps it), by the chief trainer's rank alone under torchrun
    (a group torchrun restarts finds its dead chief's lock stale). A no-op without a checkpoint
    directory and on the other torchrun ranks. Raises :class:`CheckpointError` naming the
    directory if another job holds it, and ConfigError if a job that starts afresh finds
    committed checkpoints there."""
    if config.checkpoint_dir is None:
        return contextlib.nullcontext()
    if launcher == "torchrun" and int(os.environ.get("RANK", "-1")) != config.servers:
        check_fresh_start(config)
        return contextlib.nullcontext()
    lock = lock_directory(config.checkpoint_dir)  # first: a live job's lock is the reason
    try:
        check_fresh_start(config)
    except BaseException:
        lock.release()
        raise
    return lock


def summarize(chief: TrainerOutcome, config: TrainConfig, wall_s: float) -> dict[str, Any]:
    """The job summary (the ``--summary-json`` object) from the chief's gathered statistics.

    Every figure covers this run, the work done since it started or resumed over the time
    it took (a resumed run's rates are its own, not the whole job's samples over its seconds):
    steps, samples, seconds, bytes, calls, server counters. ``resumed_from`` says where a
    resumed run began. The ``tables`` counters are the exception: they belong to the tables,
    are saved in checkpoints and count from the job's start.
    """
    assert chief.server_stats is not None
    server_stats = chief.server_stats
    reports = _trainer_reports(server_stats)
    servers = [{k: v for k, v in s.items() if k not in _JOB_WIDE_STATS} for s in server_stats]
    departed = sorted({t for stats in server_stats for t in stats["departed"]})
    total_steps = sum(r.steps for r in reports)
    return {
        "mode": config.mode,
        "servers": config.servers,
        "trainers": config.trainers,
        "steps": total_steps,
        "trainer_steps": [r.steps for r in reports],
        **_samples_loss_and_time(reports, wall_s),
        "resumed_from": _resumed_from(chief.report.resumed_at, reports),
        "bytes": _bytes_moved(reports, servers),
        "bytes_per_step": {
            "push": sum(r.bytes_sent for r in reports) / max(total_steps, 1),
            "pull": sum(r.bytes_received for r in reports) / max(total_steps, 1),
        },
        # Under the threads launcher every trainer reports the one shared process.
        "peak_rss_mb_per_trainer": [r.peak_rss_bytes / 2**20 for r in reports],
        "startup": startup.startup_seconds(),  # the chief's phases (this is its process)
        "input_bytes": _input_bytes(reports),
        "row_bytes_per_step": sum(r.row_bytes_received for r in reports) / max(total_steps, 1),
        "cache": _cache_figures(config, reports),
        "compression_ratio": _compression_ratios(reports),
        "server_stats": servers,
        "tables": _summed_table_counters(server_stats),
        "departed_trainers": departed,
        # Per departed trainer, the longest silence after which a server declared it departed.
        "departed_after_s": {
            str(t): max(s["departed_after_silence_s"].get(t, 0.0) for s in server_stats)
            for t in departed
        },
        "staleness": _staleness_histogram(server_stats),
        # Per operation, over every trainer's calls: latency percentiles and bytes.
        "calls": _call_summaries(reports),
        "consistency": merge_checks([r.consistency for r in reports if r.consistency]),
        "eval_history": chief.evals,
        "lr": _learning_rates(chief.report, config, server_stats),
    }


def _learning_rates(
    chief: TrainerReport, config: TrainConfig, server_stats: list[dict[str, Any]]
) -> dict[str, float]:
    """Each group's learning rate (``dense``, each table) at the chief's last training step:
    the rate that step's gradients were applied at (step 0's if it made none)."""
    last = max(chief.resumed_steps + chief.steps - 1, 0)
    tables = sorted({name for stats in server_stats for name in stats["tables"]})
    return config.learning_rates.at(last, tables)


# What a server reports about the whole job rather than about itself: summed or merged over the
# servers into keys of their own, left out of each server's entry in ``server_stats``.
_JOB_WIDE_STATS = ("reports", "left", "tables", "departed", "staleness", "departed_after_silence_s")


def _trainer_reports(server_stats: list[dict[str, Any]]) -> list[TrainerReport]:
    """Every trainer's report, in trainer order (each server holds those it received)."""
    reports: dict[int, TrainerReport] = {}
    for stats in server_stats:
        reports.update(stats["reports"])
    return [reports[t] for t in sorted(reports)]


def _samples_loss_and_time(reports: list[TrainerReport], wall_s: float) -> dict[str, Any]:
    train_seconds = max((r.train_seconds for r in reports), default=0.0)
    samples = sum(r.samples for r in reports)
    losses = [r.train_loss for r in reports if not math.isnan(r.train_loss)]
    return {
        "samples": samples,
        "samples_per_s": samples / train_seconds if train_seconds > 0 else 0.0,
        "train_loss": sum(losses) / len(losses) if losses else float("nan"),
        "train_seconds": train_seconds,
        "wall_s": wall_s,
    }


def _resumed_from(checkpoint_step: int, reports: list[TrainerReport]) -> dict[str, Any] | None:
    """Where a resumed run began (None for a run from the start)."""
    if checkpoint_step < 0:
        return None
    return {
        "checkpoint_step": checkpoint_step,
        "trainer_steps": [r.resumed_steps for r in reports],
        "samples": sum(r.resumed_samples for r in reports),
    }


def _bytes_moved(
    reports: list[TrainerReport], servers: list[dict[str, Any]]
) -> dict[str, dict[str, int]]:
    return {
        "trainers": {
            "sent": sum(r.bytes_sent for r in reports),
            "received": sum(r.bytes_received for r in reports),
        },
        "servers": {
            "sent": sum(s["bytes_sent"] for s in servers),
            "received": sum(s["bytes_received"] for s in servers),
        },
    }


def _input_bytes(reports: list[TrainerReport]) -> list[int] | None:
    """Per trainer, the bytes of input it read; None unless every trainer's data counted them."""
    counted = [r.input_bytes for r in reports if r.input_bytes is not None]
    return counted if len(counted) == len(reports) else None


def _cache_figures(config: TrainConfig, reports: list[TrainerReport]) -> dict[str, Any]:
    hits = sum(r.cache_hits for r in reports)
    lookups = sum(r.cache_lookups for r in reports)
    return {
        "rows_per_table": config.cache_rows,
        "lag": config.cache_lag,
        "hit_rate": _ratio(hits, lookups) if config.cache_rows else 0.0,
    }


def _compression_ratios(reports: list[TrainerReport]) -> dict[str, float]:
    """Bytes on the wire over what the same messages would take without codecs."""
    return {
        "push": _ratio(
            sum(r.bytes_sent for r in reports), sum(r.uncompressed_bytes_sent for r in reports)
        ),
        "pull": _ratio(
            sum(r.bytes_received for r in reports),
            sum(r.uncompressed_bytes_received for r in reports),
        ),
    }


def _summed_table_counters(server_stats: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Each table's counters, summed over the servers holding its rows."""
    tables: dict[str, dict[str, int]] = {}
    for stats in server_stats:
        for name, counters in stats["tables"].items():
            total = tables.setdefault(name, {})
            for key, value in counters.items():
                total[key] = total.get(key, 0) + value
    return tables


def _staleness_histogram(server_stats: list[dict[str, Any]]) -> dict[int, int]:
    """How many gradients arrived at each age, over the servers (each measures its own): the
    summary's ``staleness``, the one thing that word names (the SSP bound is ``ssp_bound``)."""
    staleness: dict[int, int] = {}
    for stats in server_stats:
        for age, count in stats["staleness"].items():
            staleness[age] = staleness.get(age, 0) + count
    return dict(sorted(staleness.items()))


def _call_summaries(reports: list[TrainerReport]) -> dict[str, dict[str, Any]]:
    calls: dict[str, CallStats] = {}
    for report in reports:
        for op, stats in report.calls.items():
            calls.setdefault(op, CallStats()).merge(stats)
    return {op: stats.summary() for op, stats in sorted(calls.items())}


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 1.0


def _leave_if_stuck(name: str, config: TrainConfig) -> Callable[[BaseException], None]:
    """What a trainer other than the chief does when its alarm goes off: if it was declared
    departed and its loop is still blocked (in its data, say) a grace period later, its
    process leaves the job (exit status 0: the job goes on without it, as with any departed
    trainer), so no launcher waits on it forever."""

    def on_alarm(error: BaseException) -> None:
        if not isinstance(error, TrainerDepartedError):
            return  # a lost server: the loop's next wait raises it

        def leave() -> None:
            log.warning("%s leaves the job, its loop still blocked: %s", name, error)
            logging.shutdown()
            os._exit(0)

        timer = threading.Timer(config.trainer_timeout, leave)
        timer.daemon = True
        timer.start()

    return on_alarm


def run_rank(
    rank: int,
    config: TrainConfig,
    model_fn: ModelFn,
    loop_fn: LoopFn,
    *,
    init_method: str,
    loopback_only: bool,
    on_progress: Callable[[Progress], None] | None = None,
    evaluation: Evaluation | None = None,
) -> ChiefResult | None:
    """Play rank ``rank``'s role in an RPC job: ranks ``0..S-1`` serve, the rest train.

    Returns the chief's result on the chief trainer, ``None`` elsewhere. Returns
    only once every rank is done (the RPC world shuts down together).
    """
    from paramserver.transport import rpc as rpc_transport

    startup.mark("interpreter")
    torch.set_num_threads(config.threads_per_process)
    started = time.perf_counter()
    name = _rank_name(rank, config)
    log.info("%s joining the job (%d servers, %d trainers)", name, config.servers, config.trainers)
    endpoint = build_server(rank, config, model_fn) if rank < config.servers else None
    if endpoint is not None:
        rpc_transport.expose(endpoint)
    rpc_transport.start(
        name,
        rank,
        config.world_size,
        init_method=init_method,
        num_threads=config.rpc_threads,
        timeout_s=config.rpc_timeout,
        loopback_only=loopback_only,
    )
    startup.mark("rendezvous")
    if endpoint is not None:
        _serve(name, endpoint)
        return None
    group = None if config.dense_on_servers else trainer_group(rank, config, init_method)
    try:
        outcome = _train(rank, name, config, model_fn, loop_fn, on_progress, evaluation, group)
    finally:
        if group is not None:
            group.close()
    if outcome is None or outcome.state is None:
        return None
    summary = summarize(outcome, config, time.perf_counter() - started)
    return ChiefResult(outcome.state, summary, outcome.value)


def _rank_name(rank: int, config: TrainConfig) -> str:
    from paramserver.transport import rpc as rpc_transport

    if rank < config.servers:
        return rpc_transport.server_name(rank)
    return rpc_transport.trainer_name(rank - config.servers)


def trainer_group(rank: int, config: TrainConfig, init_method: str) -> TrainerGroup:
    """Rank ``rank``'s place in the trainers' group (``--dense-sync allreduce``), met where the
    RPC world met: beside its rendezvous file, or through torchrun's store. Its timeout is the
    stall limit: a trainer may be that long in its own work before the others give up."""
    trainer, size = rank - config.servers, config.trainers
    if init_method.startswith("file://"):
        path = init_method.removeprefix("file://") + ".trainers"
        return CollectiveGroup.through_file(path, trainer, size, config.stall_limit)
    return CollectiveGroup.through_torchrun(trainer, size, config.stall_limit)


def _serve(name: str, endpoint: ServerEndpoint) -> None:
    """Serve until the chief has gathered the results; then leave with everyone (or alone, if a
    trainer departed: its process may be gone, and a joint shutdown would wait on it)."""
    from paramserver.transport import rpc as rpc_transport

    while not endpoint.finished.wait(1.0):
        lost = endpoint.coordinator.chief_lost()
        if lost is not None:  # no one is left to end the job
            endpoint.coordinator.close()
            rpc_transport.stop(graceful=False)
            raise JobFailedError(
                f"{name}: the chief trainer (trainer0) is lost before ending the job: "
                f"{lost}; stopping"
            )
    endpoint.coordinator.close()
    if not endpoint.graceful:
        time.sleep(LEAVE_ALONE_DELAY_S)  # let the answer to finish_job go out first
    rpc_transport.stop(graceful=endpoint.graceful)
    rpc_transport.expose(None)


def _train(
    rank: int,
    name: str,
    config: TrainConfig,
    model_fn: ModelFn,
    loop_fn: LoopFn,
    on_progress: Callable[[Progress], None] | None,
    evaluation: Evaluation | None,
    group: TrainerGroup | None,
) -> TrainerOutcome | None:
    """Train as trainer ``rank - S`` until the job ends, then leave the RPC world; None if this
    trainer, not the chief, was declared departed and left the job."""
    from paramserver.transport import rpc as rpc_transport

    chief = rank == config.servers
    transport = rpc_transport.RpcTransport(config.servers, config.rpc_timeout)
    try:
        outcome = run_trainer(
            rank - config.servers,
            config,
            model_fn,
            loop_fn,
            transport,
            on_progress,
            evaluation,
            on_alarm=None if chief else _leave_if_stuck(name, config),
            group=group,
        )
    except TrainerDepartedError as error:
        rpc_transport.stop(graceful=False)
        if chief:  # the job cannot end well without it
            raise
        # Declared departed while frozen or cut off: the job went on without this trainer.
        log.warning("%s leaves the job: %s", name, error)
        return None
    except BaseException:
        rpc_transport.stop(graceful=False)
        raise
    rpc_transport.stop(graceful=outcome.graceful)
    return outcome
