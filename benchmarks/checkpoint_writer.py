"""A checkpoint writer to SIGKILL at random moments, and the harness that kills it and checks.

Run as a script this module is a *zygote*: it imports torch once (seconds on a busy machine) and
then, per ``spawn ROOT`` line on stdin, forks a writer that commits checkpoints 1, 2, 3, ... (or
from the newest one it finds) under ROOT forever; ``reap PID`` waits for a killed writer. The
forked writer runs no code the zygote has not imported, and the zygote itself runs no torch op
before forking, so the fork is safe. :class:`WriterZygote` drives it; :func:`kill_trial` runs
one kill and checks what a reader then loads. Used by benchmarks/stress_checkpoint.py (many
trials) and tests/test_checkpoint_store.py (a few); it lives here because benchmarks import
nothing from tests.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from paramserver.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    commit,
    load_latest,
    verify,
    write_part,
)

KEEP = 2


def expected_parts(step: int) -> dict[str, dict[str, Tensor]]:
    """The parts of checkpoint ``step``, about 3.5 MB, every element a function of the step."""
    n = 512 * 1024
    mixed = (torch.arange(n, dtype=torch.int64) * (step + 1)) % 1_000_003
    return {
        "server-0": {
            "weight": mixed.to(torch.float32),
            "rows": torch.arange(64 * 1024, dtype=torch.int64) + step,
        },
        "trainer-0": {
            "dense": mixed[: 256 * 1024].to(torch.float32).reshape(256, 1024).t(),
            "step": torch.tensor(step),
        },
    }


def write_forever(root: Path) -> None:
    """Commit a checkpoint per step, after the newest one under ``root``, until killed."""
    found = load_latest(root)
    step = found.step + 1 if found is not None else 1
    while True:
        directory = checkpoint_dir(root, step)
        parts = [
            write_part(directory, name, tensors, {"step": step, "part": name})
            for name, tensors in expected_parts(step).items()
        ]
        commit(root, step, parts, {"step": step, "writer_pid": os.getpid()}, keep=KEEP)
        step += 1


def serve() -> None:
    """The zygote's loop: one reply line per request line; on EOF kill what it still runs."""
    children: set[int] = set()
    print("ready", flush=True)
    for line in sys.stdin:
        command, argument = line.split()
        if command == "spawn":
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    write_forever(Path(argument))
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(code)  # no atexit handlers, no flush of the zygote's buffers
            children.add(pid)
            print(pid, flush=True)
        elif command == "reap":
            pid = int(argument)
            _, status = os.waitpid(pid, 0)
            children.discard(pid)
            print(status, flush=True)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


class WriterZygote:
    """A running zygote; use as a context manager so that every writer dies with it."""

    def __init__(self, start_timeout: float = 60.0) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._live: set[int] = set()
        try:
            ready = self._request(None, start_timeout)
            if ready != "ready":
                raise RuntimeError(f"checkpoint writer zygote said {ready!r}")
        except BaseException:
            self.close()
            raise

    def spawn(self, root: Path) -> int:
        """Start a writer on ``root``; its pid."""
        pid = int(self._request(f"spawn {root}", 10.0))
        self._live.add(pid)
        return pid

    def kill(self, pid: int) -> int:
        """SIGKILL writer ``pid`` (this pid only) and wait until it is gone; its wait status."""
        os.kill(pid, signal.SIGKILL)  # the zygote reaps only after this, so pid is not reused
        status = int(self._request(f"reap {pid}", 10.0))
        self._live.discard(pid)
        return status

    def close(self) -> None:
        for pid in list(self._live):
            self.kill(pid)
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> WriterZygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, line: str | None, timeout: float) -> str:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        if line is not None:
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
        # One reply line per request, so nothing is ever left in the reader's buffer.
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"checkpoint writer zygote did not answer {line!r} in {timeout} s")
        reply = self._proc.stdout.readline().strip()
        if not reply:
            raise RuntimeError(f"checkpoint writer zygote exited (code {self._proc.poll()})")
        return reply


@dataclass
class TrialResult:
    ok: bool
    detail: str
    committed_before_kill: int  # the newest step seen in LATEST before the kill
    loaded_step: int | None


def latest_step(root: Path) -> int | None:
    """The step LATEST names, None if there is no LATEST. Raises ValueError if it holds anything
    but a checkpoint name: it is replaced atomically, so no reader may ever see it half-written."""
    try:
        text = (root / "LATEST").read_text(errors="replace")
    except FileNotFoundError:
        return None
    digits = text.strip().removeprefix("ckpt-")
    if not (text.startswith("ckpt-") and digits.isdigit()):
        raise ValueError(f"LATEST holds {text[:40]!r}")
    return int(digits)


def kill_trial(
    zygote: WriterZygote,
    root: Path,
    rng: random.Random,
    max_delay: float = 0.3,
    timeout: float = 20.0,
) -> TrialResult:
    """Start a writer on ``root``, wait for its first commit, SIGKILL it after a random delay in
    ``[0, max_delay]`` s, and check that the newest checkpoint loads, verifies and holds exactly
    the tensors of its step. Until the kill, LATEST is read every 2 ms as a concurrent reader
    would: it must never be torn, vanish or go back."""
    before = latest_step(root)
    delay = rng.uniform(0.0, max_delay)
    pid = zygote.spawn(root)
    try:
        committed, problem = _watch_latest(root, before, delay, timeout)
    finally:
        zygote.kill(pid)
    if problem is not None or committed is None:
        return TrialResult(False, f"while writer {pid} ran: {problem}", before or -1, None)
    return check_latest(root, committed)


def _watch_latest(
    root: Path, before: int | None, delay: float, timeout: float
) -> tuple[int | None, str | None]:
    """Poll LATEST until ``delay`` s after it first moves past ``before``: the last step seen,
    or what was wrong with it."""
    deadline = time.monotonic() + timeout
    kill_at: float | None = None
    last = before
    while kill_at is None or time.monotonic() < kill_at:
        try:
            step = latest_step(root)
        except ValueError as e:
            return last, f"a reader saw a torn LATEST: {e}"
        if last is not None and (step is None or step < last):
            return last, f"LATEST went from step {last} to {step}"
        if kill_at is None and step is not None and (before is None or step > before):
            kill_at = time.monotonic() + delay
        if kill_at is None and time.monotonic() > deadline:
            raise TimeoutError(f"the writer committed nothing in {timeout} s")
        last = step
        time.sleep(0.002)
    return last, None


def check_latest(root: Path, committed: int) -> TrialResult:
    """What a restarted job would load: the checkpoint LATEST names, intact, not older than
    ``committed``, with every tensor and metadata value as written."""
    try:
        found = load_latest(root)
    except CheckpointError as e:
        return TrialResult(False, f"load_latest raised {e}", committed, None)
    if found is None:
        return TrialResult(False, "load_latest found no checkpoint", committed, None)

    def fail(detail: str) -> TrialResult:
        return TrialResult(False, f"{found.directory.name}: {detail}", committed, found.step)

    problems = verify(found.directory)
    if problems:
        return fail(f"does not verify after loading: {problems}")
    if found.step < committed:
        return fail(f"older than step {committed}, which LATEST named before the kill")
    try:
        named = latest_step(root)
    except ValueError as e:
        return fail(str(e))
    if named != found.step:
        return fail(f"is not the checkpoint LATEST names (step {named})")
    if found.meta.get("step") != found.step:
        return fail(f"meta {found.meta} is not for its step")
    expected = expected_parts(found.step)
    if list(found.part_names) != sorted(expected):
        return fail(f"parts {found.part_names}, expected {sorted(expected)}")
    for name, want in expected.items():
        try:
            tensors, meta = found.read_part(name)
        except CheckpointError as e:
            return fail(f"read_part raised {e}")
        if meta != {"step": found.step, "part": name}:
            return fail(f"part {name}: meta {meta}")
        if not same_tensors(tensors, want):
            return fail(f"part {name}: tensors differ from step {found.step}'s")
    return TrialResult(True, "ok", committed, found.step)


def same_tensors(got: dict[str, Tensor], want: dict[str, Tensor]) -> bool:
    """Same keys, dtypes, shapes and bits."""
    return got.keys() == want.keys() and all(
        got[k].dtype == want[k].dtype and got[k].shape == want[k].shape and torch.equal(got[k], v)
        for k, v in want.items()
    )


if __name__ == "__main__":
    serve()
