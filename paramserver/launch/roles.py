"""What each role does, independent of how it was launched, and the job summary."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from paramserver.changelog.log import ChainFollower
from paramserver.changelog.publisher import Publisher
from paramserver.changelog.recover import recover_store
from paramserver.checkpoint import (
    DENSE_PART,
    Saved,
    check_checkpoint_dir,
    load_latest,
    lock_directory,
    resume_from,
)
from paramserver.config import Launcher, Mode, PublishSection, TrainConfig
from paramserver.errors import CheckpointError, JobFailedError, TrainerDepartedError
from paramserver.metrics import Evaluation
from paramserver.modelplan import build_model, plan_of
from paramserver.observe import startup
from paramserver.server.coordinator import Coordinator
from paramserver.server.endpoint import ServerEndpoint
from paramserver.server.shard import ServerShard
from paramserver.store.snapshot import model_signature, restore_store
from paramserver.trainer.loop import TrainerOutcome, run_trainer
from paramserver.transport.group import CollectiveGroup, TrainerGroup
from paramserver.transport.sockets import listening_host
from paramserver.types import LoopFn, ModelFn, Progress

if TYPE_CHECKING:
    from paramserver.transport.rpc import RestartBoard

log = logging.getLogger(__name__)

LEAVE_ALONE_DELAY_S = 0.5


@dataclass
class ChiefResult:
    """What a job gives back on the chief trainer: the final parameters (empty without
    ``gather_model``), the summary, and what ``loop_fn`` returned."""

    state: dict[str, Tensor]
    summary: dict[str, Any]
    value: Any = None


def build_server(
    server: int, config: TrainConfig, model_fn: ModelFn, *, recovering: bool = False
) -> ServerEndpoint:
    """Server ``server``'s endpoint, holding its shard of one seeded ``model_fn()``: the dense
    parameters and persistent buffers placed on it and its own rows of each table (the model's
    tables are never built whole, see :func:`~paramserver.modelplan.build_model`). Server 0
    keeps the other buffers as built, which trainers fetch at their start. ``recovering``:
    restarted after its process died, it rebuilds where that one's log ends
    (:func:`recover_server`)."""
    built = build_model(model_fn, config.seed)
    plan = plan_of(built.model, config.servers, config.dense_on_servers)
    config.check_tables(plan.tables)
    dense: dict[str, Tensor] = {
        n: p for n, p in built.model.named_parameters() if n in plan.dense_server
    }
    dense.update({n: b for n, b in built.model.named_buffers() if n in plan.buffer_server})
    settings = config.shard_settings(plan.tables)
    shard = ServerShard(server, plan, dense, built.inits, settings)
    buffers = (
        {n: b.detach().clone() for n, b in built.model.named_buffers() if n not in plan.buffers}
        if server == 0
        else {}
    )
    del built, dense
    coordinator = Coordinator(shard, config.consistency)
    if recovering:
        recover_server(shard, coordinator, config)
    elif config.resume:
        resume_server(shard, coordinator, config)
    if config.publish_dir is not None:  # after a resume: what it restored is not a change
        publishing = config.sections.publish
        between_calls = (
            coordinator.cut_between_calls().cut
            if publishing.recover and config.mode != "sync"  # a sync round is cut in its thread
            else contextlib.nullcontext
        )
        publisher = publisher_of(
            shard, publishing, config.mode, books=coordinator.recovery_books,
            between_calls=between_calls,
        )  # fmt: skip
        coordinator.publish_to(publisher)
    return ServerEndpoint(coordinator, buffers)


def publisher_of(
    shard: ServerShard,
    settings: PublishSection,
    mode: Mode,
    *,
    books: Callable[[], dict[str, Any]],
    between_calls: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> Publisher:
    """Server ``shard``'s publisher: on a timer, or in sync mode at the chief's rounds; with
    ``--recover``, with recovery sections holding the server's ``books()``, each timed cut
    inside ``between_calls()``."""
    assert settings.publish_dir is not None
    return Publisher(
        shard.store,
        settings.publish_dir,
        f"{socket.gethostname()}:{os.getpid()}",
        every_s=settings.publish_every,
        codec=settings.publish_codec,
        keep=settings.publish_keep,
        timed=mode != "sync",
        recovers=settings.recover,
        books=books,
        between_calls=between_calls,
    )


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
    signature = model_signature(shard.store)

    def saved() -> Iterator[Saved]:
        for name in names:
            tensors, meta = found.read_part(name)
            if meta.get("signature") != signature:
                raise CheckpointError(
                    f"{found.directory}: {name} was saved from a different model "
                    "(other parameters, tables or shapes)"
                )
            yield tensors, meta

    restore_store(shard.store, saved())
    coordinator.resume_at(found.step)
    log.info("server %d resumed from %s", shard.server, found.directory)


def recover_server(shard: ServerShard, coordinator: Coordinator, config: TrainConfig) -> None:
    """Rebuild a server whose process died where its change log ends: its part of the newest
    checkpoint (if any), then its log's segments since, and its books as the last of them
    holds them (see :mod:`paramserver.changelog.recover`). A damaged last segment is left out,
    and said so: the trainers send again what the segments before it do not hold."""
    assert config.publish_dir is not None
    started = time.perf_counter()
    found = load_latest(config.checkpoint_dir) if config.checkpoint_dir is not None else None
    if found is not None and found.meta.get("servers") != config.servers:
        found = None  # the one the job resumed from onto this count: its log starts full
    saved: list[Saved] = []
    if found is not None:
        tensors, meta = found.read_part(f"server-{shard.server}")
        if meta.get("signature") != model_signature(shard.store):
            raise CheckpointError(f"{found.directory}: saved from a different model")
        saved.append((tensors, meta))
    after = int(saved[0][1]["sequence"]) if saved else 0
    chain = ChainFollower(config.publish_dir, shard.server, after, most=sys.maxsize)
    segments, damage = chain.pending()
    if damage is not None:
        log.warning(
            "server %d recovers from the %d segments before a damaged one (the trainers send "
            "again what they do not hold): %s", shard.server, len(segments), damage,
        )  # fmt: skip
    recover_store(shard.store, saved, segments)
    if found is not None:
        coordinator.resume_at(found.step)  # in sync mode every trainer's call was that step
        if "books" in saved[0][1]:  # an async server's checkpoint: each trainer's own
            coordinator.recover_books(saved[0][1]["books"])
    books = next((s.recovery.books for s in reversed(segments) if s.recovery), None)
    if books:
        coordinator.recover_books(books)
    shard.stats.recovery = {
        "checkpoint_step": found.step if found is not None else None,
        "segments": len(segments),
        "damaged_segment": None if damage is None else str(damage),
        "restore_s": time.perf_counter() - started,
    }
    log.warning(
        "server %d recovered from %s and %d log segments in %.2f s", shard.server,
        found.directory if found is not None else "its initial state", len(segments),
        shard.stats.recovery["restore_s"],
    )  # fmt: skip


def hold_checkpoint_dir(
    config: TrainConfig, launcher: Launcher
) -> contextlib.AbstractContextManager[object]:
    """The lock on ``--checkpoint-dir`` (see :mod:`paramserver.checkpoint.lock`), taken now, for
    the job to hold until it ends: by the launching process under the threads and processes
    launchers (so ``--max-restarts`` keeps it), by the chief trainer's rank alone under torchrun
    (a group torchrun restarts finds its dead chief's lock stale). A no-op without a checkpoint
    directory and on the other torchrun ranks. Raises :class:`CheckpointError` naming the
    directory if another job holds it, and ConfigError where the checkpoints there do not fit
    the job (:func:`~paramserver.checkpoint.resume.check_checkpoint_dir`)."""
    if config.checkpoint_dir is None:
        return contextlib.nullcontext()
    if launcher == "torchrun" and int(os.environ.get("RANK", "-1")) != config.servers:
        check_checkpoint_dir(config)
        return contextlib.nullcontext()
    lock = lock_directory(config.checkpoint_dir)  # first: a live job's lock is the reason
    try:
        check_checkpoint_dir(config)
    except BaseException:
        lock.release()
        raise
    return lock


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
    restarts: RestartBoard | None = None,
    generation: int = 0,
) -> ChiefResult | None:
    """Play rank ``rank``'s role in an RPC job: ranks ``0..S-1`` serve, the rest train.

    Returns the chief's result on the chief trainer, ``None`` elsewhere. Returns
    only once every rank is done (the RPC world shuts down together). With ``--recover``,
    ``restarts`` is where the launcher announces a server it restarted (every rank then moves
    to the next world) and ``generation`` the world this process starts in: a server
    started in any but the first was restarted, and recovers its shard (:func:`recover_server`).
    """

    startup.mark("interpreter")
    torch.set_num_threads(config.threads_per_process)
    started = time.perf_counter()
    name = _rank_name(rank, config)
    log.info("%s joining the job (%d servers, %d trainers)", name, config.servers, config.trainers)
    endpoint = _join(rank, name, config, model_fn, init_method, loopback_only, restarts, generation)
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
    summary = outcome.summary(config, time.perf_counter() - started)
    return ChiefResult(outcome.state, summary, outcome.value)


def _join(
    rank: int,
    name: str,
    config: TrainConfig,
    model_fn: ModelFn,
    init_method: str,
    loopback_only: bool,
    restarts: RestartBoard | None,
    generation: int,
) -> ServerEndpoint | None:
    """Join the RPC world of ``generation`` as ``name``; a server first builds (or recovers)
    its shard and serves it from the world's first moment. Returns the server's endpoint
    (None on a trainer)."""
    from paramserver.transport import rpc as rpc_transport

    endpoint = None
    if rank < config.servers:
        endpoint = build_server(rank, config, model_fn, recovering=generation > 0)
        data_host = listening_host(loopback_only) if config.data_sockets else None
        # A socket's limit only guards against nonsense: the coordinator refuses a call over
        # --max-message-mb with a message naming it.
        rpc_transport.expose(
            endpoint, data_host=data_host, max_data_bytes=2 * config.max_message_bytes + 2**20
        )
    if generation > 0 and restarts is not None:  # restored: the others join it now
        restarts.announce(generation, joining=True)
    rpc_transport.start(
        name,
        rank,
        config.world_size,
        init_method=init_method,
        num_threads=config.rpc_threads,
        timeout_s=config.rpc_timeout,
        loopback_only=loopback_only,
        generation=generation,
        rendezvous_s=config.recover_wait if generation else None,
    )
    if config.recover and restarts is not None:
        pause = None if endpoint is None else endpoint.coordinator.liveness.pause
        rpc_transport.watch_restarts(restarts, config.recover_wait, pause)
    return endpoint


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
