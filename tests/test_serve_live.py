"""`paramserver serve` following a live `paramserver train` job, on loopback: tritonclient (HTTP
and gRPC, unchanged) reads versions that advance while the job trains; serving from a
checkpoint and serving from the job's initial model end at the same model, bitwise."""

from __future__ import annotations

import random
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http

from paramserver.cli import JOB_RECORD, recorded_job
from paramserver.serving.follow import Follower
from paramserver.serving.model import ServedModel
from paramserver.serving.protocol import version_parameters
from tests.procs import REPO, SMALL_JOB, free_port, stop, wait_until

pytestmark = pytest.mark.system

TABLES = [f"embeddings.{i}.weight" for i in range(8)]


def start(*args: str, log: Path) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "paramserver", *args], cwd=REPO, stdout=out, stderr=out
    )


def serve(publish: Path, log: Path, *extra: str) -> tuple[subprocess.Popen[bytes], int, int]:
    http, grpc = free_port(), free_port()
    process = start(
        "serve", "--follow", str(publish), "--http-port", str(http), "--grpc-port", str(grpc),
        "--poll-every", "0.05", *extra, log=log,
    )  # fmt: skip
    client = triton_http.InferenceServerClient(f"127.0.0.1:{http}")

    def ready() -> bool:
        try:
            return bool(client.is_server_ready())
        except Exception:
            return process.poll() is not None  # died: stop waiting, the test says why

    wait_until(ready, 60, "serve to answer")
    assert process.poll() is None, log.read_text()
    return process, http, grpc


def lookup(client, module, table: str, ids: np.ndarray) -> tuple[np.ndarray, int, str]:
    given = module.InferInput("ids", list(ids.shape), "INT64")
    given.set_data_from_numpy(ids)
    result = client.infer(table, [given])
    response = result.get_response()
    if module is triton_http:
        parameters = response["parameters"]
        version, steps = parameters["served_version"], parameters["steps"]
    else:
        version = response.parameters["served_version"].int64_param
        steps = response.parameters["steps"].string_param
    return result.as_numpy("rows"), version, steps


def every_row(http: int) -> dict[str, np.ndarray]:
    client = triton_http.InferenceServerClient(f"127.0.0.1:{http}")
    return {t: lookup(client, triton_http, t, np.arange(2000))[0] for t in TABLES}


def test_serve_follows_a_live_sync_job_and_any_base_ends_at_one_model(tmp_path: Path) -> None:
    publish, checkpoints = tmp_path / "log", tmp_path / "ckpt"
    train = start(
        "train", *SMALL_JOB, "--mode", "sync", "--steps", "150", "--no-progress",
        "--publish-dir", str(publish), "--publish-every", "0.2",
        "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "50",
        log=tmp_path / "train.log",
    )  # fmt: skip
    processes = [train]
    try:
        wait_until(lambda: (publish / "job.json").exists(), 60, "the job to record itself")
        live, http, grpc = serve(publish, tmp_path / "serve.log")
        processes.append(live)
        clients = [
            (triton_http.InferenceServerClient(f"127.0.0.1:{http}"), triton_http),
            (triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc}"), triton_grpc),
        ]
        ids = np.array([1, 5, 9, 1999, 0, 5], dtype=np.int64)
        versions = set()
        while train.poll() is None:
            answers = [lookup(c, m, "embeddings.3.weight", ids) for c, m in clients]
            versions.update(version for _, version, _ in answers)
            (rows_a, version_a, _), (rows_b, version_b, _) = answers
            if version_a == version_b:  # one version read twice: the same rows
                assert np.array_equal(rows_a, rows_b)
        assert train.wait() == 0, (tmp_path / "train.log").read_text()
        assert len(versions) >= 3  # it followed the job as it trained
        final_step = wait_until(
            lambda: (s := lookup(*clients[0], TABLES[0], ids[:1])[2]) == "0:150,1:150" and s,
            30, "the last version",
        )  # fmt: skip
        assert final_step
        from_start = every_row(http)
        based, http_based, _ = serve(  # and its tables mapped from files
            publish, tmp_path / "based.log", "--from", str(checkpoints / "ckpt-0000000100"),
            "--mmap-dir", str(tmp_path),
        )  # fmt: skip
        processes.append(based)
        wait_until(
            lambda: lookup(triton_http.InferenceServerClient(f"127.0.0.1:{http_based}"),
                           triton_http, TABLES[0], ids[:1])[2] == "0:150,1:150",
            30, "the based serving's last version",
        )  # fmt: skip
        from_checkpoint = every_row(http_based)
        for table in TABLES:
            assert np.array_equal(from_start[table], from_checkpoint[table]), table
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10) as page:
            metrics = page.read().decode()
        assert 'paramserver_served_step{server="1"} 150' in metrics
        assert 'paramserver_segments_total{outcome="refused"} 0' in metrics
    finally:
        stop(*processes)


@pytest.mark.timeout(300)  # 21 serving processes started, each loading torch (2-3 s)
def test_serve_killed_at_random_moments_while_a_job_publishes_restarts_to_one_model(
    tmp_path: Path,
) -> None:
    """SIGKILL `serve` 10 times while a job publishes; each restart replays its base and the
    log, and follows on (its versions never go back); the last one ends at the model that a
    replay of the whole log in this process ends at, bitwise."""
    publish = tmp_path / "log"
    train = start(
        "train", *SMALL_JOB, "--mode", "async", "--train-batches", "2000", "--no-progress",
        "--publish-dir", str(publish), "--publish-every", "0.5", log=tmp_path / "train.log",
    )  # fmt: skip
    processes = [train]
    rng = random.Random(0)
    try:
        wait_until(lambda: (publish / "job.json").exists(), 60, "the job to record itself")
        reached = ""
        for restart in range(10):
            process, http, _ = serve(publish, tmp_path / f"serve-{restart}.log")
            processes.append(process)
            client = triton_http.InferenceServerClient(f"127.0.0.1:{http}")
            steps = lookup(client, triton_http, TABLES[0], np.arange(3))[2]
            assert _steps(steps) >= _steps(reached), (steps, reached)  # never behind
            reached = steps
            time.sleep(rng.uniform(0.0, 0.5))
            process.kill()
            process.wait(30)
        assert train.wait(timeout=300) == 0, (tmp_path / "train.log").read_text()
        last, http, _ = serve(publish, tmp_path / "serve-last.log")
        processes.append(last)
        replayed = replay(publish)
        wait_until(
            lambda: lookup(triton_http.InferenceServerClient(f"127.0.0.1:{http}"), triton_http,
                           TABLES[0], np.arange(1))[2] == replayed.steps,
            30, "the last version",
        )  # fmt: skip
        served = every_row(http)
        for table in TABLES:
            assert np.array_equal(served[table], replayed.rows[table]), table
    finally:
        stop(*processes)


def _steps(text: str) -> list[int]:
    return [int(pair.split(":")[1]) for pair in text.split(",") if pair]


@dataclass
class Replayed:
    steps: str
    rows: dict[str, np.ndarray]


def replay(publish: Path) -> Replayed:
    """The whole log applied in this process, from the job's initial model."""
    job = recorded_job(publish / JOB_RECORD)
    served = ServedModel(job.model_fn, job.config.seed)
    follower = Follower(served, publish)
    while follower.poll():
        pass
    assert follower.problems == {}
    rows = {t: served.lookup(t, torch.arange(2000))[0].numpy() for t in TABLES}
    return Replayed(version_parameters(served.version)["steps"], rows)
