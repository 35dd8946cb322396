"""Local launcher: S server and T trainer processes on this machine, supervised.

Each process is a fresh interpreter (``python -m paramserver.launch.worker``) started in its own
session, so a Ctrl-C reaches only this launcher, which then stops every process it started. A
process that fails stops the job: the others are terminated (SIGTERM, then SIGKILL after a grace
period) by pid, and :class:`~paramserver.errors.JobFailedError` names the failed process. The
exception: a trainer other than the chief killed by a signal is left behind, and the job goes on
without it (its servers declare it departed). The
children also die with the launcher itself (see :mod:`paramserver.launch.worker`).

With ``--max-restarts`` a failed job is started again, whole, from its newest checkpoint; the
launcher keeps each attempt's course (its trainers' progress lines, how it ended) and the
summary then covers the whole run (:class:`Run`).

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
from paramserver.checkpoint.resume import resume_point
from paramserver.config import TrainConfig
from paramserver.errors import JobFailedError
from paramserver.launch.roles import ChiefResult
from paramserver.launch.stopping import STOP_SIGNAL, stops_gracefully
from paramserver.launch.worker import GENERATION_VARIABLE
from paramserver.metrics import Evaluation
from paramserver.observe import startup
from paramserver.observe.summary import cover_attempts
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
    counted in the same ``--max-restarts``. The summary covers every attempt (see
    :class:`Run`)."""
    run = Run(config)
    while True:
        attempt = run.begin(config)
        try:
            result = _run_group(
                config, model_fn, loop_fn, on_progress, evaluation, run.server_restarts,
                config.max_restarts - len(run.restarts) - len(run.server_restarts), attempt,
            )  # fmt: skip
        except JobFailedError as error:
            if len(run.restarts) + len(run.server_restarts) >= config.max_restarts:
                raise
            found = load_latest(config.checkpoint_dir) if config.checkpoint_dir else None
            run.failed(attempt, error, None if found is None else found.step)
            log.warning(
                "%s; restarting the job (%d of %d) %s",
                error,
                len(run.restarts),
                config.max_restarts,
                "from its newest checkpoint" if found is not None else "from the start",
            )
            config = config.replace(resume=found is not None)
            continue
        run.finished(attempt, result.summary)
        return result


class Run:
    """A run of the processes launcher: its attempts (each a run of every process) and the
    restarts between them, as the launcher saw them, in seconds from the run's start; the
    servers restarted alone under ``--recover``; and where the run began. It makes the
    finished attempt's summary the whole run's (:func:`cover_attempts`)."""

    def __init__(self, config: TrainConfig):
        self.started = time.monotonic()
        # Where the run began, read before any process starts (a resume's checkpoint).
        self.began = resume_point(config.checkpoint_dir) if config.resume else None
        self.attempts: list[Attempt] = []
        self.restarts: list[dict[str, Any]] = []
        self.server_restarts: list[dict[str, Any]] = []

    def begin(self, config: TrainConfig) -> Attempt:
        """The next attempt: the first where the run began, a later one where the restart
        that started it resumes."""
        if self.restarts:
            resumed_from = self.restarts[-1]["resumed_from"]
        else:
            resumed_from = None if self.began is None else self.began["checkpoint_step"]
        attempt = Attempt(self.started, resumed_from, config.trainers)
        self.attempts.append(attempt)
        return attempt

    def failed(self, attempt: Attempt, error: JobFailedError, resumes_from: int | None) -> None:
        """``attempt`` failed with ``error``; the next resumes from checkpoint
        ``resumes_from`` (None: from the start)."""
        attempt.ended_s = attempt.now()
        attempt.ended = str(error)
        if attempt.first_step_s is not None:
            attempt.train_seconds = attempt.ended_s - attempt.first_step_s
        failure = attempt.failure or {"process": None, "exit": None, "error": str(error)}
        self.restarts.append({**failure, "at_s": attempt.ended_s, "resumed_from": resumes_from})

    def finished(self, attempt: Attempt, summary: dict[str, Any]) -> None:
        attempt.ended_s, attempt.ended = attempt.now(), "finished"
        attempt.trainer_steps = dict(enumerate(summary["trainer_steps"]))
        attempt.train_seconds = summary["train_seconds"]
        for restart, following in zip(self.restarts, self.attempts[1:], strict=True):
            first = following.first_step_s
            restart["paused_s"] = None if first is None else round(first - restart["at_s"], 3)
        summary["server_restarts"] = self.server_restarts
        attempts = [a.record() for a in self.attempts]
        cover_attempts(summary, attempts, self.restarts, self.began, attempt.now())


class Attempt:
    """One run of every process, as the launcher saw it: when it started and ended (seconds
    from the run's start), the checkpoint it resumed from, each trainer's steps (from its
    progress lines: the first says where it started), when the first step ended, and how it
    ended."""

    def __init__(self, run_started: float, resumed_from: int | None, trainers: int):
        self.run_started = run_started
        self.trainers = trainers
        self.started_s = self.now()
        self.ended_s = self.started_s
        self.resumed_from = resumed_from
        self.first_step_s: float | None = None
        self.started_at: dict[int, int] = {}  # trainer -> its steps before this attempt's first
        self.trainer_steps: dict[int, int] = {}  # trainer -> the steps it trained in it
        self.train_seconds = 0.0
        self.failure: dict[str, Any] | None = None  # the failed process: process, exit, error
        self.ended = ""

    def now(self) -> float:
        return round(time.monotonic() - self.run_started, 3)

    def progressed(self, progress: Progress) -> None:
        """A trainer's progress line: its steps so far (counting those before the resume)."""
        if self.first_step_s is None:
            self.first_step_s = self.now()
        first = self.started_at.setdefault(progress.trainer, progress.steps - 1)
        self.trainer_steps[progress.trainer] = progress.steps - first

    def record(self) -> dict[str, Any]:
        trainers = range(self.trainers)
        return {
            "started_s": self.started_s,
            "ended_s": self.ended_s,
            "resumed_from": self.resumed_from,
            "trainer_steps": [self.trainer_steps.get(t, 0) for t in trainers],
            "train_seconds": round(self.train_seconds, 3),
            "ended": self.ended,
        }


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
    attempt: Attempt | None = None,
) -> ChiefResult:
    """One run of every process; ``server_restarts`` gets the servers restarted alone (at
    most ``restarts_left``), ``attempt`` what the launcher sees of it."""
    run_dir = Path(tempfile.mkdtemp(prefix="paramserver-"))
    group = ProcessGroup(config, run_dir, server_restarts, restarts_left, attempt)
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
        attempt: Attempt | None = None,
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
        self.attempt = attempt or Attempt(time.monotonic(), None, config.trainers)
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
                "at_s": self.attempt.now(),
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
                    self._read_what_is_written(on_progress)
                    self.attempt.failure = self.failure_record(role, code)
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
        for line in lines:
            progress = Progress(**json.loads(line))
            self.attempt.progressed(progress)
            if on_progress is not None:
                on_progress(progress)

    def _read_what_is_written(self, on_progress: Callable[[Progress], None] | None) -> None:
        """The progress lines written so far (a failing job's last steps count too)."""
        for key, _ in self.selector.select(timeout=0):
            self._read_progress(int(key.fd), on_progress)

    def failure(self, role: str, pid: int, code: int) -> str:
        """The job's error when ``role`` failed; led by the lost server when a trainer failed
        because it lost one (a frozen server's process still runs: only the trainer exits)."""
        failed = f"{role} (pid {pid}) {describe_exit(code)}{self.reason(role)}; stopped the job"
        try:
            lost = int((self.run_dir / f"{role}.lost").read_text())
        except (FileNotFoundError, ValueError):
            return failed
        return f"server{lost} was lost: {failed}"

    def failure_record(self, role: str, code: int) -> dict[str, Any]:
        """The failure as the summary's ``restarts`` lists it: the process that failed, how
        it exited and what it said; led, as :meth:`failure`, by the server a trainer lost."""
        record = {"process": role, "exit": describe_exit(code), "error": self.said(role)}
        try:
            lost = int((self.run_dir / f"{role}.lost").read_text())
        except (FileNotFoundError, ValueError):
            return record
        error = f"{role} {record['exit']}: {record['error']}"
        return {"process": f"server{lost}", "exit": "was lost", "error": error}

    def reason(self, role: str) -> str:
        """What the process said before it failed, if it could, after a colon."""
        said = self.said(role)
        return f": {said}" if said else ""

    def said(self, role: str) -> str:
        """What the process said before it failed ("" if it could not)."""
        try:
            return (self.run_dir / f"{role}.error").read_text().strip()
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
