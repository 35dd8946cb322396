"""`paramserver serve` run as the README's "Serving while it trains" runs it (`serve --follow
log`, no `--from`) on a log its job pruned (`--publish-keep`): it serves the job's newest
checkpoint and follows on, or, where the job kept none, refuses with exit status 2 saying what
to pass; it is never ready with the job's initial model. And `served_version`, a place in the
log, rises across a restart of `serve` while the job trains.

Everything is asked of the serving process as a client asks it: the ready endpoint
(`GET /v2/health/ready`), tritonclient's predictions and each answer's `served_version`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as triton_http

from paramserver import cli
from paramserver.changelog.log import MANIFEST
from paramserver.serving.model import ServedModel
from paramserver.serving.run import load_export
from tests.procs import SMALL_JOB, free_port, stop, wait_until
from tests.serving_helpers import raw_http

pytestmark = pytest.mark.system

PRUNING = ("--publish-every", "0.05", "--publish-keep", "2")


def start(*args: str, cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "paramserver", *args], cwd=cwd, stdout=out, stderr=out
    )


def start_serving(cwd: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    process = start(
        "serve", "--follow", "log", "--http-port", str(port), "--grpc-port", str(free_port()),
        "--poll-every", "0.05", cwd=cwd, log=log,
    )  # fmt: skip
    return process, port


def ready_or_exited(process: subprocess.Popen[bytes], port: int) -> bool:
    """Whether ``process`` answers ready (True) before it exits (False); asked every 50 ms."""

    def seen() -> str | None:
        try:
            status, _ = raw_http(port, "GET", "/v2/health/ready", b"")
            if status == 200:
                return "ready"
        except OSError:  # not listening yet, or never
            pass
        return "exited" if process.poll() is not None else None

    return wait_until(seen, 90, "serve to answer ready or exit") == "ready"


def pruned(publish: Path) -> bool:
    """Whether each server's log lists no longer its chain's first segment."""
    chains = sorted(publish.glob("server-*"))
    firsts = [json.loads((chain / MANIFEST).read_text())["segments"][0] for chain in chains]
    return len(chains) == 2 and all(entry["sequence"] > 1 for entry in firsts)


def predict(port: int, dense: np.ndarray, sparse: np.ndarray) -> tuple[np.ndarray, int, str]:
    client = triton_http.InferenceServerClient(f"127.0.0.1:{port}")
    given = [
        triton_http.InferInput("dense", list(dense.shape), "FP32"),
        triton_http.InferInput("sparse", list(sparse.shape), "INT64"),
    ]
    given[0].set_data_from_numpy(dense)
    given[1].set_data_from_numpy(sparse)
    result = client.infer("model", given)
    parameters = result.get_response()["parameters"]
    return result.as_numpy("output"), parameters["served_version"], parameters["steps"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("checkpoints", [True, False], ids=["with checkpoints", "without"])
def test_serve_on_a_pruned_log_serves_the_trained_model_or_refuses_never_the_initial(
    tmp_path: Path, checkpoints: bool
) -> None:
    kept = ("--checkpoint-dir", "ckpt", "--checkpoint-every", "40") if checkpoints else ()
    train = start(
        "train", *SMALL_JOB, "--launcher", "threads", "--train-batches", "120",
        "--no-progress", "--publish-dir", "log", *PRUNING, *kept,
        cwd=tmp_path, log=tmp_path / "train.log",
    )  # fmt: skip
    assert train.wait(timeout=180) == 0, (tmp_path / "train.log").read_text()
    assert pruned(tmp_path / "log")  # what the test is about: the job's start is gone
    serving, port = start_serving(tmp_path, tmp_path / "serve.log")
    try:
        ready = ready_or_exited(serving, port)
        said = (tmp_path / "serve.log").read_text()
        if not checkpoints:  # nothing of the job's to serve: refused, never ready
            assert not ready and serving.wait(30) == 2, said
            assert "no longer reach back to the job's initial model" in said, said
            assert "pass --from" in said, said
            return
        assert ready, said
        job = cli.recorded_job(tmp_path / "log" / cli.JOB_RECORD)
        generator = torch.Generator().manual_seed(0)
        dense = torch.rand(16, 13, generator=generator)
        sparse = torch.randint(0, 2000, (16, 8), generator=generator)
        scores, version, steps = predict(port, dense.numpy(), sparse.numpy())
        assert version > 0 and steps, (version, steps)  # a place in the log, not the start
        initial = ServedModel(job.model_fn, job.config.seed)
        assert not np.array_equal(scores, initial.predict([dense, sparse])[0].numpy())
        assert cli.main(["export", str(tmp_path / "ckpt"), str(tmp_path / "final.pt")]) == 0
        exported = ServedModel(job.model_fn, job.config.seed)
        load_export(exported, tmp_path / "final.pt")
        assert np.array_equal(scores, exported.predict([dense, sparse])[0].numpy())
    finally:
        stop(serving)


@pytest.mark.timeout(300)
def test_served_version_rises_across_a_restart_of_serve(tmp_path: Path) -> None:
    """A job trains and prunes its log; `serve` follows it, is stopped, and started again
    (from the job's newest checkpoint): the first version the new process answers is past
    the last the old one answered, and its versions rise on from there."""
    train = start(
        "train", *SMALL_JOB, "--launcher", "threads", "--train-batches", "6000",
        "--no-progress", "--publish-dir", "log", *PRUNING, "--checkpoint-dir", "ckpt",
        "--checkpoint-every", "100", cwd=tmp_path, log=tmp_path / "train.log",
    )  # fmt: skip
    processes = [train]
    dense, sparse = np.zeros((2, 13), dtype=np.float32), np.arange(16).reshape(2, 8)
    try:
        wait_until(lambda: (tmp_path / "log" / cli.JOB_RECORD).exists(), 60, "the job")
        first, port = start_serving(tmp_path, tmp_path / "serve-1.log")
        processes.append(first)
        assert ready_or_exited(first, port), (tmp_path / "serve-1.log").read_text()
        before = wait_until(lambda: (v := predict(port, dense, sparse)[1]) >= 20 and v,
                            60, "20 places in the log")  # fmt: skip
        wait_until(lambda: pruned(tmp_path / "log"), 120, "a checkpoint, then the log pruned")
        first.terminate()
        assert first.wait(30) == 0
        time.sleep(1.0)  # the job publishes on meanwhile
        assert train.poll() is None, "the job ended too soon"
        second, port = start_serving(tmp_path, tmp_path / "serve-2.log")
        processes.append(second)
        assert ready_or_exited(second, port), (tmp_path / "serve-2.log").read_text()
        seen = [predict(port, dense, sparse)[1] for _ in range(20)]
        assert seen[0] > before and seen == sorted(seen), (before, seen)
    finally:
        stop(*processes)
