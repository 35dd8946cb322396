"""Multi-process jobs over real RPC on loopback: parity with the in-process run, failures,
listening sockets, the CLI and Ctrl-C. Each test kills only the processes its job started."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import paramserver as ps
from paramserver.types import Progress
from tests.helpers import TinyRecModel, mse, nan_loss, tiny_batches
from tests.procs import (
    REPO,
    SMALL_JOB,
    children_of_launcher,
    free_port,
    is_loopback,
    listening_addresses,
    stop,
    wait_until,
)

# Starts processes or whole jobs: the system tier.
pytestmark = [pytest.mark.timeout(180), pytest.mark.system]


def test_sync_over_rpc_equals_the_in_process_run_and_ships_closures() -> None:
    scale = 0.5  # captured by the closures below: they must travel by value

    def data(trainer: int, num_trainers: int) -> Any:
        return tiny_batches(trainer, num_batches=8)

    config = ps.TrainConfig(
        servers=2,
        trainers=2,
        mode="sync",
        optimizer="adam",
        lr=0.01,
        launcher="processes",
        progress=False,
    )
    over_rpc = ps.train(TinyRecModel, data, lambda o, t: mse(o, t) * scale, config)
    in_process = ps.train(
        TinyRecModel, data, lambda o, t: mse(o, t) * scale, config.replace(launcher="threads")
    )
    assert over_rpc is not None and in_process is not None
    for name, value in in_process.model.state_dict().items():
        torch.testing.assert_close(over_rpc.model.state_dict()[name], value, msg=name)
    assert over_rpc.summary["trainer_steps"] == [8, 8]
    assert over_rpc.summary["bytes"]["servers"]["received"] > 0
    assert children_of_launcher(os.getpid()) == []


def test_a_failing_trainer_stops_the_job_with_its_error_and_leaves_no_process() -> None:
    def data(trainer: int, num_trainers: int) -> Any:
        for i, batch in enumerate(tiny_batches(trainer, num_batches=50)):
            if trainer == 1 and i == 3:
                raise RuntimeError("disk on fire")
            time.sleep(0.02)
            yield batch

    config = ps.TrainConfig(servers=2, trainers=2, launcher="processes", progress=False)
    started = time.monotonic()
    with pytest.raises(
        ps.JobFailedError, match="trainer1 .*exited with status 1: RuntimeError: disk on fire"
    ):
        ps.train(TinyRecModel, data, mse, config)
    assert time.monotonic() - started < 60
    assert children_of_launcher(os.getpid()) == []


def test_a_rejected_push_keeps_its_type_across_rpc() -> None:
    config = ps.TrainConfig(servers=1, trainers=1, launcher="processes", progress=False)
    with pytest.raises(ps.JobFailedError, match="InvalidPushError: server 0: parameter .* NaN"):
        ps.train(TinyRecModel, lambda t, n: tiny_batches(t, num_batches=3), nan_loss, config)


def test_a_local_job_listens_on_loopback_only() -> None:
    def slow_data(trainer: int, num_trainers: int) -> Any:
        for batch in tiny_batches(trainer, num_batches=60):
            time.sleep(0.05)
            yield batch

    config = ps.TrainConfig(servers=2, trainers=2, launcher="processes", progress=False)
    progress: list[Progress] = []
    outcome: dict[str, Any] = {}
    job = threading.Thread(
        target=lambda: outcome.update(
            result=ps.train(TinyRecModel, slow_data, mse, config, on_progress=progress.append)
        )
    )
    job.start()
    wait_until(lambda: len(progress) >= 2, 60, "the job to start training")
    pids = children_of_launcher(os.getpid())
    assert len(pids) == 4
    addresses = listening_addresses(pids)
    job.join(timeout=120)
    assert addresses, "found no listening socket at all: the check is vacuous"
    assert all(is_loopback(a) for a in addresses), addresses
    assert outcome["result"] is not None


def run_cli(*args: str, **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "paramserver", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


def test_cli_runs_a_job_and_writes_the_summary(tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    process = run_cli(
        "train",
        *SMALL_JOB,
        "--train-batches",
        "40",
        "--mode",
        "sync",
        "--summary-json",
        str(summary_path),
    )
    output, _ = process.communicate(timeout=150)
    assert process.returncode == 0, output
    summary = json.loads(summary_path.read_text())
    for key in (
        "steps",
        "samples",
        "samples_per_s",
        "train_loss",
        "eval_auc",
        "eval_logloss",
        "wall_s",
        "bytes",
    ):
        assert key in summary, key
    assert summary["steps"] == 40 and summary["samples"] == 40 * 256
    [attempt] = summary["attempts"]  # one run of every process, finished: no restart
    assert attempt["ended"] == "finished" and attempt["resumed_from"] is None
    assert attempt["trainer_steps"] == summary["trainer_steps"] and summary["restarts"] == []
    assert "attempt 1" not in output and f"train loss     {summary['train_loss']:.4f}" in output
    assert set(summary["bytes"]) == {"trainers", "servers"}
    assert summary["bytes"]["trainers"]["received"] == summary["bytes"]["servers"]["sent"] > 0
    assert 0.5 < summary["eval_auc"] <= summary["eval_auc_ceiling"]
    assert "held-out AUC" in output
    startup = summary["startup"]  # every phase was reached, and they add up to the total
    phases = ("launch", "interpreter", "rendezvous", "model", "first_step")
    assert all(startup[p] is not None and startup[p] >= 0 for p in phases), startup
    assert math.isclose(sum(startup[p] for p in phases), startup["total"], abs_tol=1e-6)
    assert startup["launch"] > 0 and startup["interpreter"] > 0  # two interpreters started
    assert startup["total"] < summary["wall_s"] + startup["launch"]


def default_sigint() -> None:
    """In the child: Ctrl-C's default action, whatever this run inherited (a shell's background
    job starts with SIGINT ignored, and Python then never raises KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_every_process_it_started() -> None:
    process = run_cli(
        "train", *SMALL_JOB, "--train-batches", "100000", "--log-every", "0.2",
        preexec_fn=default_sigint,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        wait_until(lambda: len(children_of_launcher(process.pid)) == 4, 60, "the job's processes")
        children = children_of_launcher(process.pid)
        for line in process.stdout:  # wait until training runs, so RPC is up everywhere
            if "samples/s" in line:
                break
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=30)
    finally:
        stop(process)  # a failed wait must not leave the job training
    assert process.returncode == 130, output
    assert "interrupted" in output
    for pid in children:
        assert (
            not Path(f"/proc/{pid}").exists()
            or Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        )


def test_runs_under_torchrun(tmp_path: Path) -> None:
    summary_path = tmp_path / "summary.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    process = subprocess.run(
        [
            str(torchrun),
            "--nnodes",
            "1",
            "--nproc-per-node",
            "3",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "--rdzv-backend",
            "static",
            "--node-rank",
            "0",
            "-m",
            "paramserver",
            "train",
            "--servers",
            "1",
            "--trainers",
            "2",
            *SMALL_JOB,
            "--train-batches",
            "20",
            "--no-progress",
            "--summary-json",
            str(summary_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert process.returncode == 0, process.stdout + process.stderr
    summary = json.loads(summary_path.read_text())
    assert summary["trainers"] == 2 and summary["servers"] == 1
    assert summary["steps"] == 20
    for role in ("server0", "trainer0", "trainer1"):  # each rank's log lines name its role
        assert f"[{role}]" in process.stderr, role
