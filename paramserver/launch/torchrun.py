"""Running under torchrun: every rank runs the same program; the role comes from ``RANK``.

The first ``--servers`` ranks serve, the others train. ``WORLD_SIZE`` must equal servers plus
trainers. The RPC world meets through torchrun's store (``env://``).

With ``--recover``, a server rank does not serve in its own process: it supervises a worker
process that does (:func:`supervise_server`), and starts it anew, alone, when a signal kills
it; torchrun itself would restart every rank. The restart is announced in torchrun's agent
store (:class:`~paramserver.transport.rpc.StoreBoard`), where every rank watches for it.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paramserver.config import TrainConfig
from paramserver.errors import ConfigError, JobFailedError
from paramserver.launch.processes import (
    RESTARTING_ALONE,
    describe_exit,
    start_worker,
    worker_environment,
    write_spec,
)
from paramserver.launch.roles import ChiefResult, run_rank
from paramserver.launch.worker import GENERATION_VARIABLE, die_with_parent
from paramserver.metrics import Evaluation
from paramserver.transport.rpc import StoreBoard, announce_restart
from paramserver.types import LoopFn, ModelFn, Progress

GRACE_S = 3.0
POLL_S = 0.1

log = logging.getLogger(__name__)


def run_torchrun_rank(
    config: TrainConfig,
    model_fn: ModelFn,
    loop_fn: LoopFn,
    on_progress: Callable[[Progress], None] | None = None,
    evaluation: Evaluation | None = None,
) -> ChiefResult | None:
    # Die with torchrun's agent: a killed agent must leave no rank behind.
    die_with_parent(os.getppid())
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != config.world_size:
        raise ConfigError(
            f"torchrun started {world_size} ranks but --servers {config.servers} plus --trainers "
            f"{config.trainers} needs {config.world_size}; set --nproc-per-node/--nnodes to match"
        )
    board = StoreBoard.of_torchrun() if config.recover else None
    if board is not None and rank < config.servers:
        supervise_server(rank, config, model_fn, loop_fn, board)
        return None
    result = run_rank(
        rank,
        config,
        model_fn,
        loop_fn,
        init_method="env://",
        loopback_only=False,
        on_progress=on_progress,
        evaluation=evaluation,
        restarts=board,
    )
    if result is not None and board is not None:
        board.finish()
        result.summary["server_restarts"] = board.restart_records()
    if result is not None:
        result.summary["restarts"] = group_restarts(result.summary)
    return result


def group_restarts(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The restarts of every rank torchrun made before this attempt, as far as a rank knows
    them: their count (``TORCHELASTIC_RESTART_COUNT``) and where this attempt resumed; which
    rank failed, why and when are in torchrun's log. This attempt's figures are the
    summary's."""
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    resumed = summary["resumed_from"]
    restarts = [
        {
            "process": None,
            "exit": None,
            "at_s": None,
            "resumed_from": None,
            "paused_s": None,
            "error": "torchrun restarted every rank (its log says which failed and why)",
        }
        for _ in range(count)
    ]
    if restarts and resumed is not None:
        restarts[-1]["resumed_from"] = resumed["checkpoint_step"]
    return restarts


def supervise_server(
    rank: int, config: TrainConfig, model_fn: ModelFn, loop_fn: LoopFn, board: StoreBoard
) -> None:
    """Run server ``rank`` in a worker process; one that a signal killed is started anew,
    alone, at most ``--max-restarts`` times, to rebuild its shard from its checkpoint and
    change log while the other ranks wait. Returns once the server ended well; raises
    :class:`JobFailedError` where it failed (torchrun then stops the job)."""
    started = time.monotonic()
    run_dir = Path(tempfile.mkdtemp(prefix="paramserver-"))
    spec = write_spec(run_dir, config, model_fn, loop_fn, None, board, loopback_only=False)
    env, role = worker_environment(), f"server{rank}"
    restarts_left, generation = config.max_restarts, 0
    try:
        while True:
            worker = start_worker(spec, rank, {**env, GENERATION_VARIABLE: str(generation)})
            try:
                code = _exit_of(worker, board)
            finally:
                if worker.poll() is None:  # this rank is stopped (torchrun's SIGTERM, say)
                    worker.terminate()
                    worker.wait(GRACE_S)
            if code == 0 or board.finished():  # the job ended without it
                return
            if code > 0 or restarts_left <= 0:
                said = run_dir / f"{role}.error"
                reason = f": {said.read_text().strip()}" if said.exists() else ""
                raise JobFailedError(f"{role} (pid {worker.pid}) {describe_exit(code)}{reason}")
            restarts_left -= 1
            log.warning(RESTARTING_ALONE, role, describe_exit(code), restarts_left)
            generation = announce_restart(board)
            record = {
                "server": rank, "exit": describe_exit(code),
                "at_s": round(time.monotonic() - started, 3), "generation": generation,
            }  # fmt: skip
            board.record_restart(generation, record)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _exit_of(worker: subprocess.Popen[bytes], board: StoreBoard) -> int:
    """``worker``'s exit status; 0 for one the job finished without (a server restarted as the
    job ended has no world to join), once it had ``GRACE_S`` to end on its own."""
    while worker.poll() is None:
        if board.finished():
            try:
                return worker.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                return 0
        time.sleep(POLL_S)
    return worker.returncode
