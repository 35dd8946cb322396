"""Local launcher: S server and T trainer processes on this machine, supervised.

Each process is a fresh interpreter (``python -m paramserver.launch.worker``) started in its own
session, so a Ctrl-C reaches only this launcher, which then stops every process it started. A
process that fails stops the job: the others are terminated (SIGTERM, then SIGKILL after a grace
period) by pid, and :class:`~paramserver.errors.JobFailedError` names the failed process. The
children also die with the launcher itself (see :mod:`paramserver.launch.worker`).

Loopback only: the RPC world meets through a file in a private temporary directory (no TCP
rendezvous) and TensorPipe is bound to ``lo``.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import torch
from torch import Tensor

from paramserver.config import TrainConfig
from paramserver.errors import JobFailedError
from paramserver.trainer.loop import DataFn, LossFn, ModelFn, Progress

GRACE_S = 3.0


def run_processes(
    config: TrainConfig,
    model_fn: ModelFn,
    data_fn: DataFn,
    loss_fn: LossFn,
    on_progress: Callable[[Progress], None] | None = None,
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    run_dir = Path(tempfile.mkdtemp(prefix="paramserver-"))
    spec = run_dir / "job.pkl"
    spec.write_bytes(
        cloudpickle.dumps(
            {"config": config, "model_fn": model_fn, "data_fn": data_fn, "loss_fn": loss_fn}
        )
    )
    group = ProcessGroup(config, run_dir)
    try:
        group.start(spec)
        group.supervise(on_progress)
        state = torch.load(run_dir / "state.pt", weights_only=True)
        summary = json.loads((run_dir / "summary.json").read_text())
        return state, summary
    finally:
        group.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


class ProcessGroup:
    def __init__(self, config: TrainConfig, run_dir: Path):
        self.config = config
        self.run_dir = run_dir
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.selector = selectors.DefaultSelector()

    def role(self, rank: int) -> str:
        servers = self.config.servers
        return f"server{rank}" if rank < servers else f"trainer{rank - servers}"

    def start(self, spec: Path) -> None:
        env = dict(os.environ)
        env["PARAMSERVER_LAUNCHER_PID"] = str(os.getpid())
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        for rank in range(self.config.world_size):
            read_fd, write_fd = (-1, -1)
            if rank >= self.config.servers:
                read_fd, write_fd = os.pipe()
            command = [
                sys.executable,
                "-m",
                "paramserver.launch.worker",
                str(spec),
                str(rank),
                str(write_fd),
            ]
            pass_fds = (write_fd,) if write_fd >= 0 else ()
            self.processes[self.role(rank)] = subprocess.Popen(
                command,
                env=env,
                pass_fds=pass_fds,
                start_new_session=True,
                stdin=subprocess.DEVNULL,
            )
            if write_fd >= 0:
                os.close(write_fd)
                reader = os.fdopen(read_fd, "r")
                self.selector.register(reader, selectors.EVENT_READ)

    def supervise(self, on_progress: Callable[[Progress], None] | None) -> None:
        """Relay progress until every process exits; raise on the first failure."""
        while True:
            for key, _ in self.selector.select(timeout=0.1):
                line = key.fileobj.readline()  # type: ignore[union-attr]
                if not line:
                    self.selector.unregister(key.fileobj)
                    key.fileobj.close()  # type: ignore[union-attr]
                elif on_progress is not None:
                    on_progress(Progress(**json.loads(line)))
            running = 0
            for role, process in self.processes.items():
                code = process.poll()
                if code is None:
                    running += 1
                elif code != 0:
                    raise JobFailedError(
                        f"{role} (pid {process.pid}) {describe_exit(code)}"
                        f"{self.reason(role)}; stopped the job"
                    )
            if running == 0:
                return

    def reason(self, role: str) -> str:
        """What the process said before it failed, if it could."""
        try:
            return ": " + (self.run_dir / f"{role}.error").read_text().strip()
        except FileNotFoundError:
            return ""

    def stop(self) -> None:
        """Terminate every process still running, by pid; SIGKILL those that linger."""
        alive = [p for p in self.processes.values() if p.poll() is None]
        for process in alive:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for process in alive:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self.selector.close()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"
