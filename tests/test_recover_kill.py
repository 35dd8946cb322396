"""A server SIGKILLed during a job with ``--recover`` restarts alone and loses nothing: a sync job
ends bitwise where an uninterrupted one ends (under the processes launcher and under torchrun),
also with its server killed three times (once while it is restored) and with its newest log
segment damaged; an async job applies every push once (each row's count of updates as in an
uninterrupted run)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import paramserver as ps
from paramserver.checkpoint import load_latest
from paramserver.cli import print_summary
from tests.helpers import (
    RECOVER_BATCHES,
    TinyRecModel,
    mse,
    recover_job_config,
    slow_tiny_batches,
)
from tests.procs import (
    REPO,
    children_of_launcher,
    descendants,
    free_port,
    rank_pid,
    stop,
    wait_until,
)

pytestmark = pytest.mark.system


def final_parts(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the job's final checkpoint, by part and name."""
    found = load_latest(root / "ckpt")
    assert found is not None and found.meta.get("final") and found.step == RECOVER_BATCHES
    tensors: dict[str, torch.Tensor] = {}
    for server in (0, 1):
        part, _ = found.read_part(f"server-{server}")
        tensors.update({f"server-{server}/{name}": value for name, value in part.items()})
    return tensors


def segments_of(root: Path, server: int) -> list[dict[str, Any]]:
    manifest = root / "log" / f"server-{server}" / "MANIFEST.json"
    try:
        return list(json.loads(manifest.read_text())["segments"])
    except (FileNotFoundError, ValueError):
        return []


def run_with_kills(
    root: Path, mode: str, kill: Callable[[], None], restarts: int
) -> dict[str, Any]:
    """The job's summary, ``kill()`` run meanwhile in this thread."""
    outcome: dict[str, Any] = {}

    def job() -> None:
        try:
            outcome["summary"] = ps.train(
                TinyRecModel, slow_tiny_batches, mse, recover_job_config(root, mode, True, restarts)
            ).summary
        except Exception as error:  # the test reports it
            outcome["error"] = error

    thread = threading.Thread(target=job)
    thread.start()
    try:
        kill()
    finally:
        thread.join(timeout=200)
    assert not thread.is_alive()
    assert "error" not in outcome, outcome.get("error")
    assert children_of_launcher(os.getpid()) == []
    return dict(outcome["summary"])


def kill_once_logging(root: Path, rng: random.Random) -> None:
    """SIGKILL server 1 at a random moment once its log has a few segments."""
    wait_until(lambda: len(segments_of(root, 1)) >= 2, 90, "server 1's log")
    time.sleep(rng.uniform(0.0, 0.5))
    os.kill(rank_pid(1), signal.SIGKILL)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """Each mode's final checkpoint without a fault."""
    ends = {}
    for mode in ("sync", "async"):
        root = tmp_path_factory.mktemp(f"clean-{mode}")
        config = recover_job_config(root, mode, recover=False)
        ps.train(TinyRecModel, slow_tiny_batches, mse, config)
        ends[mode] = final_parts(root)
    return ends


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"not bitwise equal: {different}"


def update_counts(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each row's and dense value's count of updates applied."""
    return {n: v for n, v in parts.items() if n.endswith("/steps") or n.endswith("/step")}


@pytest.mark.timeout(300)
def test_an_async_job_whose_server_is_killed_applies_every_push_once(
    tmp_path: Path, uninterrupted: dict[str, dict[str, torch.Tensor]]
) -> None:
    run_with_kills(
        tmp_path, "async", lambda: kill_once_logging(tmp_path, random.Random(2)), restarts=1
    )
    counts = update_counts(final_parts(tmp_path))
    assert counts and counts.keys() == update_counts(uninterrupted["async"]).keys()
    assert_bitwise(update_counts(uninterrupted["async"]), counts)


@pytest.mark.timeout(300)
def test_a_server_killed_again_while_it_is_restored_and_once_more_later_loses_nothing(
    tmp_path: Path,
    uninterrupted: dict[str, dict[str, torch.Tensor]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    def kill_three_times() -> None:
        first = wait_until(lambda: _other_server1(-1), 60, "server 1")
        kill_once_logging(tmp_path, random.Random(3))
        # Its new process, at once: still starting and restoring, before it joins the others.
        restarted = wait_until(lambda: _other_server1(first), 30, "server 1 restarted")
        os.kill(restarted, signal.SIGKILL)
        rejoined = wait_until(lambda: _other_server1(restarted), 30, "server 1 restarted again")
        published = len(segments_of(tmp_path, 1))
        wait_until(
            lambda: len(segments_of(tmp_path, 1)) >= published + 2, 90, "server 1 publishing again"
        )
        os.kill(rejoined, signal.SIGKILL)

    summary = run_with_kills(tmp_path, "sync", kill_three_times, restarts=3)
    assert_bitwise(uninterrupted["sync"], final_parts(tmp_path))
    restarts = summary["server_restarts"]
    assert [r["server"] for r in restarts] == [1, 1, 1]
    assert all("SIGKILL" in r["exit"] for r in restarts)
    recovered = summary["recovery"]["servers"]
    assert recovered[0] is None and recovered[1]["damaged_segment"] is None
    assert summary["trainer_steps"] == [RECOVER_BATCHES, RECOVER_BATCHES]
    assert all(resent >= 1 for resent in summary["recovery"]["resent_calls"])
    # One attempt, no whole-job restart; each server restart within the run's wall time.
    [attempt] = summary["attempts"]
    assert attempt["ended"] == "finished" and summary["restarts"] == []
    assert attempt["trainer_steps"] == summary["trainer_steps"]
    at = [r["at_s"] for r in restarts]
    assert 0 < at[0] < at[1] < at[2] < summary["wall_s"]
    capsys.readouterr()
    print_summary(summary)  # what the command prints: every restart, the pause, the rebuild
    printed = capsys.readouterr().out
    assert printed.count("server restart server1 was killed by SIGKILL at ") == 3, printed
    assert printed.count("; rebuilt from ") == 1  # the last: recovery holds each server's last
    waited = max(summary["recovery"]["paused_s"])
    assert waited > 0 and f"recovery       training paused {waited:.1f} s" in printed
    assert f"{sum(summary['recovery']['resent_calls'])} calls sent again" in printed


def _other_server1(than: int) -> int | None:
    """Server 1's process if it is another than ``than`` (restarted), else None."""
    try:
        pid = rank_pid(1)
    except AssertionError:  # between its processes
        return None
    return pid if pid != than else None


@pytest.mark.timeout(300)
def test_a_damaged_last_segment_is_left_out_and_the_trainers_send_what_it_held(
    tmp_path: Path, uninterrupted: dict[str, dict[str, torch.Tensor]]
) -> None:
    def damage_then_kill() -> None:
        wait_until(lambda: len(segments_of(tmp_path, 1)) >= 3, 90, "server 1's log")
        pid = rank_pid(1)
        os.kill(pid, signal.SIGSTOP)  # nothing more is written while the segment is damaged
        newest = segments_of(tmp_path, 1)[-1]
        path = tmp_path / "log" / "server-1" / newest["file"]
        path.write_bytes(path.read_bytes()[: newest["size"] // 2])
        os.kill(pid, signal.SIGKILL)

    summary = run_with_kills(tmp_path, "sync", damage_then_kill, restarts=1)
    damaged = summary["recovery"]["servers"][1]["damaged_segment"]
    assert damaged is not None and "segment" in damaged
    assert_bitwise(uninterrupted["sync"], final_parts(tmp_path))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_under_torchrun_a_killed_server_restarts_alone_and_loses_nothing(
    tmp_path: Path, uninterrupted: dict[str, dict[str, torch.Tensor]], mode: str
) -> None:
    """Server 1's rank supervises the process that serves: torchrun, which would restart
    every rank, never sees it die. Sync ends bitwise as uninterrupted; async with every
    row's count of updates."""
    command = [
        str(Path(sys.executable).with_name("torchrun")), "--nnodes", "1", "--nproc-per-node",
        "4", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port",
        str(free_port()), "--rdzv-backend", "static",
        str(REPO / "tests" / "_recover_job.py"), str(tmp_path), mode,
    ]  # fmt: skip
    log = tmp_path / "torchrun.log"
    with log.open("w") as out:  # a file, not a pipe: a full pipe would stall the ranks
        job = subprocess.Popen(
            command, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
            start_new_session=True, stdout=out, stderr=out,
        )  # fmt: skip
    try:
        wait_until(lambda: len(segments_of(tmp_path, 1)) >= 2, 90, "server 1's log")
        server = wait_until(lambda: _serving(job.pid, 1), 10, "server 1's process")
        os.kill(server, signal.SIGKILL)
        restarted = wait_until(lambda: _serving(job.pid, 1, server), 30, "server 1 restarted")
        job.wait(timeout=200)
    finally:
        stop(job)
    assert job.returncode == 0, log.read_text()[-3000:]
    assert not Path(f"/proc/{restarted}").exists()
    ended, expected = final_parts(tmp_path), uninterrupted[mode]
    if mode == "async":  # its order of pushes is the race's
        ended, expected = update_counts(ended), update_counts(expected)
    assert expected
    assert_bitwise(expected, ended)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(r["server"], r["exit"]) for r in summary["server_restarts"]] == [
        (1, "was killed by SIGKILL")
    ]
    assert summary["recovery"]["servers"][1]["segments"] >= 1
    assert summary["trainer_steps"] == [RECOVER_BATCHES, RECOVER_BATCHES]


def _serving(torchrun: int, server: int, other_than: int = -1) -> int | None:
    """The process that serves ``server`` under the torchrun of pid ``torchrun`` (a worker
    its rank supervises), if there is one other than ``other_than``."""
    for pid in descendants(torchrun):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        module = b"paramserver.launch.worker"
        if pid != other_than and module in argv and argv[argv.index(module) + 2] == b"%d" % server:
            return pid
    return None
