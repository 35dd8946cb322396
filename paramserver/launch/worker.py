"""Entry point of one local job process: ``python -m paramserver.launch.worker SPEC RANK FD``.

``SPEC`` is the job file the launcher wrote (config and cloudpickled user functions), ``RANK``
this process's rank and ``FD`` a pipe to the launcher for progress lines (-1 for none). The
process dies with its launcher (``PR_SET_PDEATHSIG``), so a killed launcher leaves no orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import IO, Any, NoReturn

import cloudpickle
import torch

from paramserver.errors import ParamServerError, ServerLostError
from paramserver.launch.stopping import stop_when_asked
from paramserver.types import Progress

PR_SET_PDEATHSIG = 1
PROGRESS_INTERVAL_S = 0.2
GENERATION_VARIABLE = "PARAMSERVER_GENERATION"  # the RPC world a restarted server joins

log = logging.getLogger(__name__)


def die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the launcher still kills its children by pid
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


class ProgressWriter:
    """Sends progress lines to the launcher, at most one per PROGRESS_INTERVAL_S; the last
    one held back goes at :meth:`flush` (a failing trainer's steps count in the run's
    attempts)."""

    def __init__(self, pipe: IO[str]):
        self.pipe = pipe
        self.last_sent = 0.0
        self.held: Progress | None = None

    def __call__(self, progress: Progress) -> None:
        now = time.monotonic()
        if now - self.last_sent < PROGRESS_INTERVAL_S:
            self.held = progress
            return
        self.last_sent = now
        self.send(progress)

    def flush(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            with contextlib.suppress(OSError):  # the launcher may be gone
                self.send(held)

    def send(self, progress: Progress) -> None:
        self.held = None
        line = json.dumps(
            {
                "trainer": progress.trainer,
                "steps": progress.steps,
                "samples": progress.samples,
                "loss": progress.loss,
                "lag": progress.lag,
                "lag_unit": progress.lag_unit,
            }
        )
        self.pipe.write(line + "\n")
        self.pipe.flush()


def main(argv: list[str]) -> int:
    spec_path, rank, fd = Path(argv[0]), int(argv[1]), int(argv[2])
    die_with_parent(int(os.environ["PARAMSERVER_LAUNCHER_PID"]))
    spec = cloudpickle.loads(spec_path.read_bytes())
    config = spec["config"]
    role = f"server{rank}" if rank < config.servers else f"trainer{rank - config.servers}"
    logging.basicConfig(
        level=logging.INFO, format=f"[{role}] %(asctime)s %(message)s", datefmt="%H:%M:%S"
    )
    progress = ProgressWriter(os.fdopen(fd, "w")) if fd >= 0 else None
    if rank >= config.servers:
        stop_when_asked()
    from paramserver.launch.roles import run_rank

    board = spec["board"]
    generation = int(os.environ.get(GENERATION_VARIABLE, "0"))  # > 0: a server restarted
    try:
        result = run_rank(
            rank,
            config,
            spec["model_fn"],
            spec["loop_fn"],
            init_method=board.init_method(generation),
            loopback_only=spec["loopback_only"],
            on_progress=progress,
            evaluation=cloudpickle.loads(spec["evaluation"]) if rank == config.servers else None,
            restarts=board,
            generation=generation,
        )
    except ParamServerError as error:
        # A fault the project handles (a lost server, a refused push): the launcher names it in
        # the error it raises, and this process says it in one line; a traceback would only
        # show where the error surfaced.
        reason = f"{type(error).__name__}: {error}"
        (spec_path.parent / f"{role}.error").write_text(reason)
        if isinstance(error, ServerLostError) and error.server is not None:
            (spec_path.parent / f"{role}.lost").write_text(str(error.server))
        log.error("%s stops: %s", role, reason)
        return 1
    except BaseException as error:
        # Anything else is unexpected: the launcher names it, and its traceback goes to stderr.
        (spec_path.parent / f"{role}.error").write_text(f"{type(error).__name__}: {error}")
        raise
    finally:
        if progress is not None:  # the steps this trainer made count, however it ended
            progress.flush()
    if result is not None:
        _hand_back(spec_path.parent, result)
    return 0


def _hand_back(run_dir: Path, result: Any) -> None:
    """The chief's result, for the launcher: the final state, the summary, loop_fn's value."""
    torch.save(result.state, run_dir / "state.pt")
    (run_dir / "summary.json").write_text(json.dumps(result.summary))
    (run_dir / "value.pkl").write_bytes(cloudpickle.dumps(result.value))


def run(argv: list[str]) -> NoReturn:
    """:func:`main`, then exit by its status. A worker that fails leaves at once: its RPC
    agent's threads still run, and the interpreter's own exit would destroy them unjoined,
    which aborts the process (SIGABRT) or not, by a race, instead of exiting with status 1."""
    try:
        status = main(argv)
    except Exception:
        traceback.print_exc()
        status = 1
    if status == 0:
        sys.exit(0)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    run(sys.argv[1:])
