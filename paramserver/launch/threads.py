"""Run a whole job inside this process: servers as objects, trainers as threads.

Same roles and protocol as a multi-process job, over the in-process transport. Used by tests
and handy in notebooks; torch ops release the GIL, so trainers still overlap.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from paramserver.config import TrainConfig
from paramserver.errors import JobFailedError, TrainerDepartedError
from paramserver.launch.roles import build_server
from paramserver.metrics import Evaluation
from paramserver.server.endpoint import ServerEndpoint
from paramserver.trainer.loop import TrainerOutcome, run_trainer
from paramserver.transport.group import ThreadGroup
from paramserver.transport.local import LocalTransport
from paramserver.types import LoopFn, ModelFn, Progress

log = logging.getLogger(__name__)

CHIEF_POLL_S = 0.2


def run_threads(
    config: TrainConfig,
    model_fn: ModelFn,
    loop_fn: LoopFn,
    on_progress: Callable[[Progress], None] | None = None,
    evaluation: Evaluation | None = None,
) -> tuple[TrainerOutcome, LocalTransport]:
    """Run the job; returns the chief's outcome and the transport (its servers stay readable,
    their watchdogs stopped). No thread of the job outlives it, except a trainer declared
    departed while stuck in its own data or loop (a thread cannot be stopped; it is logged)."""
    endpoints: list[ServerEndpoint] = []
    try:
        for server in range(config.servers):
            endpoints.append(build_server(server, config, model_fn))
        return _run_trainers(config, endpoints, model_fn, loop_fn, on_progress, evaluation)
    finally:
        for endpoint in endpoints:
            endpoint.coordinator.close()


def _run_trainers(
    config: TrainConfig,
    endpoints: list[ServerEndpoint],
    model_fn: ModelFn,
    loop_fn: LoopFn,
    on_progress: Callable[[Progress], None] | None,
    evaluation: Evaluation | None,
) -> tuple[TrainerOutcome, LocalTransport]:
    transport = LocalTransport(endpoints)
    outcomes: dict[int, TrainerOutcome] = {}
    errors: dict[int, BaseException] = {}
    group = None if config.dense_on_servers else ThreadGroup(config.trainers, config.stall_limit)

    def trainer_main(rank: int) -> None:
        try:
            outcomes[rank] = run_trainer(
                rank, config, model_fn, loop_fn, transport, on_progress, evaluation,
                group=group.member(rank) if group is not None else None,
            )  # fmt: skip
        except TrainerDepartedError as error:
            if rank == 0:  # the chief: the job cannot end well without it
                errors[rank] = error
            else:  # declared departed: the job went on without this trainer
                log.warning("trainer%d leaves the job: %s", rank, error)
        except BaseException as error:  # reported below, with the trainer's rank
            errors[rank] = error
            if group is not None:  # the others' all-reduce cannot go on without it
                group.abort()
            # Leave the job so sync rounds and the chief's wait do not hang on this trainer.
            for endpoint in endpoints:
                endpoint.coordinator.remove_trainer(rank)

    threads = [
        threading.Thread(target=trainer_main, args=(r,), name=f"trainer{r}", daemon=True)
        for r in range(config.trainers)
    ]
    for thread in threads:
        thread.start()
    _wait_for_chief(threads[0], endpoints, errors)
    _join_the_others(threads, config.trainer_timeout, errors)
    if errors:  # the first to fail: the others' errors may be its consequences
        rank, error = next(iter(errors.items()))
        raise JobFailedError(f"trainer {rank} failed: {type(error).__name__}: {error}") from error
    return outcomes[0], transport


def _join_the_others(
    threads: list[threading.Thread], grace_s: float, errors: dict[int, BaseException]
) -> None:
    """A chief that succeeded ended the job once every other trainer left or departed: those
    still running after a grace period are departed and stuck in their data, and cannot be
    stopped. A chief that failed left the job: the others train on to their end."""
    deadline = time.monotonic() + grace_s if 0 not in errors else None
    for rank, thread in enumerate(threads[1:], start=1):
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            log.warning("trainer%d was declared departed and is still blocked; left behind", rank)


def _wait_for_chief(
    chief: threading.Thread, endpoints: list[ServerEndpoint], errors: dict[int, BaseException]
) -> None:
    """Wait for the chief's thread, failing the job as a server process would if the servers
    find the chief lost (stuck in its data, say): the other trainers' calls are then refused,
    so they stop too. A chief that failed is departed as well, once its error is recorded in
    ``errors``: that error, not its loss, is the job's."""
    while chief.is_alive():
        chief.join(CHIEF_POLL_S)
        lost = endpoints[0].coordinator.chief_lost()
        if lost is not None and chief.is_alive() and 0 not in errors:
            for endpoint in endpoints:
                for rank in range(endpoint.coordinator.num_trainers):
                    endpoint.coordinator.remove_trainer(rank, "the job stopped without its chief")
            raise JobFailedError(f"the chief trainer (trainer0) is lost: {lost}")
