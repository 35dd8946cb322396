"""Local launcher: S server and T trainer processes on this machine, supervised.

Each process is a fresh interpreter (``python -m paramserver.launch.worker``) started in its own
session, so a Ctrl-C reaches only this launcher, which then stops every process it started. A
process that fails stops the job: the others are terminated (SIGTERM, then SIGKILL after a grace
period) by pid, and :class:`~paramserver.errors.JobFailedError` names the failed process. The
exception: a trainer other than the chief killed by a signal is left behind, and the job goes on
without it (its servers declare it departed). The
children also die with the launcher itself (see :mod:`paramserver.launch.worker`).

Loopback only: the RPC world meets through a file in a private temporary directory (no TCP
rendezvous) and TensorPipe and Gloo are bound to ``lo`` (see :mod:`paramserver.transport.rpc`).

A fault the project handles is reported, not dumped: a process that fails with a
:class:`~paramserver.errors.ParamServerError` (a trainer that lost a server, say) logs one line
and exits with status 1, the launcher's error names the process and that line (and leads with
the server a trainer lost), and TensorPipe's C++ warnings about broken connections are off
(``TORCH_CPP_LOG_LEVEL=ERROR`` unless set). Unexpected errors keep their traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import marshal
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from collections import ChainMap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import torch

from paramserver.checkpoint import load_latest
from paramserver.config import TrainConfig
from paramserver.errors import JobFailedError
from paramserver.launch.roles import ChiefResult
from paramserver.launch.stopping import STOP_SIGNAL, stops_gracefully
from paramserver.launch.worker import GENERATION_VARIABLE
from paramserver.metrics import Evaluation
from paramserver.observe import startup
from paramserver.transport.rpc import FileBoard, RestartBoard, announce_restart
from paramserver.types import LoopFn, ModelFn, Progress

GRACE_S = 3.0
RESTARTING_ALONE = (
    "%s %s; restarting it alone, from its checkpoint and change log (%d restarts left)"
)

log = logging.getLogger(__name__)


def run_processes(
    config: TrainConfig,
    model_fn: ModelFn,
    loop_fn: LoopFn,
    on_progress: Callable[[Progress], None] | None = None,
    evaluation: Evaluation | None = None,
) -> ChiefResult:
    """Run the job; on a failure, restart the whole group up to ``--max-restarts`` times,
    resuming from the newest checkpoint (from the start if there is none yet). With
    ``--recover``, a server killed restarts alone (:meth:`ProcessGroup.restart_server`),
    counted in the same ``--max-restarts``."""
    failures: list[str] = []
    server_restarts: list[dict[str, Any]] = []
    while True:
        started = time.perf_counter()
        try:
            result = _run_group(
                config, model_fn, loop_fn, on_progress, evaluation, server_restarts,
                config.max_restarts - len(failures) - len(server_restarts),
            )  # fmt: skip
        except JobFailedError as error:
            if len(failures) + len(server_restarts) >= config.max_restarts:
                raise
            failures.append(str(error))
            resumable = config.checkpoint_dir is not None and (
                load_latest(config.checkpoint_dir) is not None
            )
            log.warning(
                "%s; restarting the job (%d of %d) %s",
                error,
                len(failures),
                config.max_restarts,
                "from its newest checkpoint" if resumable else "from the start",
            )
            config = config.replace(resume=resumable)
            continue
        result.summary["restarts"] = failures
        result.summary["server_restarts"] = server_restarts
        # This run's, as its other figures.
        result.summary["wall_s"] = time.perf_counter() - started
        return result


class _SourceKeepingPickler(cloudpickle.Pickler):
    """cloudpickle, but a function's code travels whole (``marshal``): cloudpickle renames
    the file of code it pickles by value (the user's script, ``__main__``) to
    ``<dynamic-code>``, and the user's own file and line would be gone from every traceback
    in the worker processes. The workers run this very interpreter, so its code format."""

    dispatch_table = ChainMap(
        {types.CodeType: lambda code: (marshal.loads, (marshal.dumps(code),))},
        cloudpickle.Pickler.dispatch_table,
    )


def dumps_keeping_sources(value: Any) -> bytes:
    """``value`` pickled by cloudpickle, each function keeping its file and line numbers.

    The user's script travels by value whether it runs as ``__main__`` or as a process that
    ``multiprocessing`` spawned, where it is ``__mp_main__``, a name no worker can import."""
    if "__mp_main__" in sys.modules:
        cloudpickle.register_pickle_by_value(sys.modules["__mp_main__"])
    buffer = io.BytesIO()
    _SourceKeepingPickler(buffer).dump(value)
    return buffer.getvalue()


def _run_group(
    config: TrainConfig,
    model_fn: ModelFn,
    loop_fn: LoopFn,
    on_progress: Callable[[Progress], None] | None,
    evaluation: Evaluation | None,
    server_restarts: list[dict[str, Any]],
    restarts_left: int,
) -> ChiefResult:
    """One run of every process; ``server_restarts`` gets the servers restarted alone (at
    most ``restarts_left``)."""
    run_dir = Path(tempfile.mkdtemp(prefix="paramserver-"))
    group = ProcessGroup(config, run_dir, server_restarts, restarts_left)
    spec = write_spec(run_dir, config, model_fn, loop_fn, evaluation, group.board, True)
    try:
        group.start(spec)
        with stops_gracefully(config.stream_input, group.ask_trainers_to_stop):
            group.supervise(on_progress)
        return ChiefResult(
            torch.load(run_dir / "state.pt", weights_only=True),
            json.loads((run_dir / "summary.json").read_text()),
            cloudpickle.loads((run_dir / "value.pkl").read_bytes()),
        )
    finally:
        group.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def write_spec(
    run_dir: Path,
    config: TrainConfig,
    model_fn: ModelFn,
    loop_fn: LoopFn,
    evaluation: Evaluation | None,
    board: RestartBoard,
    loopback_only: bool,
) -> Path:
    """The job file a worker process reads (see :mod:`paramserver.launch.worker`)."""
    spec = run_dir / "job.pkl"
    spec.write_bytes(
        dumps_keeping_sources(
            {
                "config": config,
                "model_fn": model_fn,
                "loop_fn": loop_fn,
                # Pickled apart: only the chief trainer loads it (held-out data can be large).
                "evaluation": dumps_keeping_sources(evaluation),
                "board": board,
                "loopback_only": loopback_only,
            }
        )
    )
    return spec


def worker_environment() -> dict[str, str]:
    """The environment of the worker processes this process starts."""
    env = dict(os.environ)
    env["PARAMSERVER_LAUNCHER_PID"] = str(os.getpid())
    env[startup.COMMAND_STARTED_AT] = repr(startup.command_started_at())
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    # TensorPipe warns in C++ of every broken connection, faults the job reports itself
    # (a lost server, a departed trainer): keep its raw lines out unless the user asks.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


def start_worker(
    spec: Path, rank: int, env: dict[str, str], progress_fd: int = -1
) -> subprocess.Popen[bytes]:
    """Rank ``rank``'s process (``progress_fd``: its end of the progress pipe, or -1)."""
    command = [sys.executable, "-m", "paramserver.launch.worker", str(spec), str(rank)]
    return subprocess.Popen(
        [*command, str(progress_fd)],
        env=env,
        pass_fds=(progress_fd,) if progress_fd >= 0 else (),
        start_new_session=True,  # Ctrl-C reaches the launcher, which stops the rest
        stdin=subprocess.DEVNULL,
    )


class ProcessGroup:
    def __init__(
        self,
        config: TrainConfig,
        run_dir: Path,
        server_restarts: list[dict[str, Any]] | None = None,
        restarts_left: int = 0,
    ):
        self.config = config
        self.run_dir = run_dir
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.selector = selectors.DefaultSelector()
        self.partial_lines: dict[int, bytes] = {}  # progress pipe fd -> bytes after last newline
        self.lost: set[str] = set()  # trainers that died and were left behind
        self.stop_asked_at: float | None = None  # a stream job asked to stop (launch.stopping)
        self.board = FileBoard(run_dir / "rendezvous")
        self.server_restarts = [] if server_restarts is None else server_restarts
        self.restarts_left = restarts_left
        self.started_at = time.monotonic()
        self._env: dict[str, str] = {}
        self._spec = run_dir / "job.pkl"

    def role(self, rank: int) -> str:
        servers = self.config.servers
        return f"server{rank}" if rank < servers else f"trainer{rank - servers}"

    def start(self, spec: Path) -> None:
        self._env, self._spec = worker_environment(), spec
        for rank in range(self.config.world_size):
            self._start_rank(rank, self._env)

    def _start_rank(self, rank: int, env: dict[str, str]) -> None:
        is_trainer = rank >= self.config.servers
        read_fd, write_fd = os.pipe() if is_trainer else (-1, -1)
        try:
            self.processes[self.role(rank)] = start_worker(self._spec, rank, env, write_fd)
        except BaseException:
            if is_trainer:
                os.close(read_fd)
            raise
        finally:
            if is_trainer:
                os.close(write_fd)
        if is_trainer:
            self.partial_lines[read_fd] = b""
            self.selector.register(read_fd, selectors.EVENT_READ)

    def restart_server(self, role: str, code: int) -> bool:
        """With ``--recover``, start a server killed by a signal anew, alone, while restarts
        are left: it rebuilds its shard from its checkpoint and log, and the others move to
        the next RPC world with it (see :func:`paramserver.transport.rpc.watch_restarts`).
        A server that failed with an error would fail again: the job stops."""
        if not (self.config.recover and role.startswith("server") and code < 0):
            return False
        chief = self.processes[self.role(self.config.servers)]
        if self.restarts_left <= 0 or chief.poll() is not None:  # none left, or the job ended
            return False
        self.restarts_left -= 1
        rank = int(role.removeprefix("server"))
        log.warning(RESTARTING_ALONE, role, describe_exit(code), self.restarts_left)
        generation = announce_restart(self.board)
        self._start_rank(rank, {**self._env, GENERATION_VARIABLE: str(generation)})
        self.server_restarts.append(
            {
                "server": rank,
                "exit": describe_exit(code),
                "at_s": round(time.monotonic() - self.started_at, 3),
                "generation": generation,
            }
        )
        return True

    def ask_trainers_to_stop(self) -> None:
        """Every trainer ends its input at its next step (see launch.stopping); asked again
        every second while they run (one still starting ignores it)."""
        self.stop_asked_at = time.monotonic()
        for role, process in self.processes.items():
            if role.startswith("trainer") and process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(STOP_SIGNAL)

    def supervise(self, on_progress: Callable[[Progress], None] | None) -> None:
        """Relay progress until every process exits; raise on the first failure."""
        while True:
            for key, _ in self.selector.select(timeout=0.1):
                self._read_progress(int(key.fd), on_progress)
            if self.stop_asked_at is not None and time.monotonic() - self.stop_asked_at >= 1.0:
                self.ask_trainers_to_stop()
            running = 0
            for role, process in list(self.processes.items()):
                code = process.poll()
                if code is None:
                    running += 1
                elif code != 0 and not self._survivable(role, code):
                    if self.restart_server(role, code):
                        running += 1
                        continue
                    raise JobFailedError(self.failure(role, process.pid, code))
            if running == 0:
                for fd in list(self.partial_lines):  # what was written before the exits
                    while fd in self.partial_lines:
                        self._read_progress(fd, on_progress)
                return

    def _survivable(self, role: str, code: int) -> bool:
        """A trainer other than the chief that died by a signal (killed, not failed with an
        error) leaves the job: servers declare it departed and the rest go on; not with
        ``--dense-sync allreduce``, whose all-reduce cannot go on without it."""
        if code >= 0 or not role.startswith("trainer") or role == "trainer0":
            return False
        if not self.config.dense_on_servers or self.config.stream_input:
            return False
        if role not in self.lost:
            self.lost.add(role)
            log.warning(
                "%s %s; the job goes on without it (servers declare it departed after "
                "--trainer-timeout %g s)",
                role,
                describe_exit(code),
                self.config.trainer_timeout,
            )
        return True

    def _read_progress(self, fd: int, on_progress: Callable[[Progress], None] | None) -> None:
        chunk = os.read(fd, 65536)
        if not chunk:
            self.selector.unregister(fd)
            os.close(fd)
            del self.partial_lines[fd]
            return
        *lines, self.partial_lines[fd] = (self.partial_lines[fd] + chunk).split(b"\n")
        if on_progress is not None:
            for line in lines:
                on_progress(Progress(**json.loads(line)))

    def failure(self, role: str, pid: int, code: int) -> str:
        """The job's error when ``role`` failed; led by the lost server when a trainer failed
        because it lost one (a frozen server's process still runs: only the trainer exits)."""
        failed = f"{role} (pid {pid}) {describe_exit(code)}{self.reason(role)}; stopped the job"
        try:
            lost = int((self.run_dir / f"{role}.lost").read_text())
        except (FileNotFoundError, ValueError):
            return failed
        return f"server{lost} was lost: {failed}"

    def reason(self, role: str) -> str:
        """What the process said before it failed, if it could."""
        try:
            return ": " + (self.run_dir / f"{role}.error").read_text().strip()
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        """Terminate every process still running and its process group (each child leads its
        own session); SIGKILL what lingers past the grace period."""
        alive = [p for p in self.processes.values() if p.poll() is None]
        for process in alive:
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for process in alive:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()
        for fd in list(self.partial_lines):
            self.selector.unregister(fd)
            os.close(fd)
        self.partial_lines.clear()
        self.selector.close()


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the process group led by ``process`` (its pid is still ours: not yet reaped)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
