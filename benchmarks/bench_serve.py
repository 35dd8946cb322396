"""Serving while training (issue 31's goals), side by side in one run:

- ``publishing``: the default DLRM job (2 servers, 2 trainers, processes) with and without
  ``--publish-dir`` at ``--publish-every 1``, alternating, samples/s (goal: >= 0.95x);
- ``freshness``: while a publishing job trains, this process follows its logs (a serving
  process: :class:`~paramserver.serving.follow.Follower`, polling every 50 ms) and records, for
  each version applied, how old its changes were when they became served: ``oldest`` (the
  segment's first change, the worst case) and ``update`` (an update taken uniformly between the
  segment's first change and its cut, as continuous training makes them); p50 and p99 (goal:
  p50 <= 1 s, p99 <= 3 s);
- ``correctness``: once the job ends and the last version is applied, every served row and
  dense value against the job's final (gathered) model, bitwise;
- ``segment_bytes``: a segment's bytes per row beyond its dense values, against 8 B (the id)
  plus the row's value bytes (+4 with int8);
- ``torn_reads``: lookups of rows that every version sets together, made while versions are
  applied back to back (goal: 0 in 10^6);
- ``latency``: ``paramserver serve`` (a process) queried by tritonclient over HTTP and gRPC: a
  lookup of 26 ids, a prediction of 100 candidates, p50/p99 (goals: 2 ms, 2 ms, 20 ms), and
  candidates predicted per second of the serving process's CPU (goal: >= 3,000); beside it,
  the plainest alternative: the final model's state_dict loaded into the model behind a
  FastAPI endpoint (uvicorn), asked the same over plain HTTP with JSON, as is our server.

    .venv/bin/python benchmarks/bench_serve.py --out benchmarks/results/bench_serve.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from report import machine, save

import paramserver as ps
from paramserver.changelog.log import server_dir, servers_under
from paramserver.changelog.segment import MAGIC, Segment, TableChanges, read_segment
from paramserver.cli import build_parser, config_from_args, record_job
from paramserver.jobs import build_job
from paramserver.serving.follow import Follower
from paramserver.serving.model import ServedModel

REPO = Path(__file__).resolve().parents[1]
JOB_FLAGS = ["--train-batches", "3000", "--no-progress"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else 0.0


def job_samples_per_s(publish_dir: Path | None) -> float:
    """The default job from the command line, its samples/s (publishing to ``publish_dir``)."""
    with tempfile.TemporaryDirectory() as scratch:
        summary = Path(scratch) / "summary.json"
        argv = ["train", *JOB_FLAGS, "--summary-json", str(summary)]
        if publish_dir is not None:
            argv += ["--publish-dir", str(publish_dir), "--publish-every", "1"]
        done = subprocess.run(
            [sys.executable, "-m", "paramserver", *argv], cwd=REPO, capture_output=True,
            text=True, timeout=900,
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"the job failed:\n{done.stderr[-3000:]}")
        return float(json.loads(summary.read_text())["samples_per_s"])


def publishing_cost(pairs: int, scratch: Path) -> dict[str, Any]:
    plain, publishing = [], []
    for run in range(pairs):
        plain.append(job_samples_per_s(None))
        publish_dir = scratch / f"cost-{run}"
        publishing.append(job_samples_per_s(publish_dir))
        shutil.rmtree(publish_dir)
    ratio = float(np.median(publishing) / np.median(plain))
    return {"plain_samples_per_s": plain, "publishing_samples_per_s": publishing,
            "ratio_of_medians": ratio, "goal": ">= 0.95"}  # fmt: skip


def served_state(served: ServedModel) -> dict[str, torch.Tensor]:
    state = {name: slot.value.clone() for name, slot in served.store.dense.items()}
    exported = served.store.export_state()
    for name, spec in served.plan.tables.items():
        rows = exported[name]
        order = torch.argsort(rows["ids"])
        if spec.dynamic is None:
            state[name] = rows["value"][order]
        else:
            state[name.removesuffix("weight") + "ids"] = rows["ids"][order]
            state[name] = rows["value"][order]
    return state


def follow_a_job(scratch: Path) -> tuple[dict[str, Any], Path, Path, Any]:
    """Train the default job publishing into ``scratch/log`` while this process follows it;
    returns freshness, correctness, the log, the final model's state_dict file, the job."""
    publish = scratch / "log"
    argv = [*JOB_FLAGS, "--publish-dir", str(publish), "--publish-every", "1"]
    args = build_parser().parse_args(["train", *argv])
    record_job(publish, argv)  # as `paramserver train` does: what `paramserver serve` rebuilds
    config = config_from_args(args)
    job = build_job(args, config)
    served = ServedModel(job.model_fn, config.seed)
    follower = Follower(served, publish, poll_s=0.05)
    oldest, update, newest = [], [], []

    def applied(segments: list[Segment], at: float) -> None:
        for segment in segments:
            if segment.first_change_at:
                oldest.append(at - segment.first_change_at)
                newest.append(at - segment.cut_at)
                update.append(at - random.uniform(segment.first_change_at, segment.cut_at))

    follower.on_applied = applied
    follower.start()
    result = ps.train(job.model_fn, job.data_fn, job.loss_fn, config.replace(batch_size=None))
    assert result is not None and result.model is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
        served.version.steps.get(s) for s in servers_under(publish)
    ):
        time.sleep(0.1)
    time.sleep(1.0)  # the last segments (the job's end) applied
    follower.close()
    follower.poll()
    final = result.model.state_dict()
    held = served_state(served)
    differing = [name for name in final if not torch.equal(held[name], final[name])]
    model_file = scratch / "model.pt"
    torch.save(final, model_file)
    figures = {
        "freshness_s": {
            "update_p50": percentile(update, 50), "update_p99": percentile(update, 99),
            "oldest_p50": percentile(oldest, 50), "oldest_p99": percentile(oldest, 99),
            "since_cut_p50": percentile(newest, 50), "segments": len(oldest),
            "goal": "update p50 <= 1, p99 <= 3",
        },
        "correctness": {
            "tensors": len(final), "differing_from_final_model": differing,
            "problems": follower.problems,
        },
    }  # fmt: skip
    return figures, publish, model_file, job


def segment_bytes(publish: Path) -> dict[str, Any]:
    """Bytes per row of the segments holding rows, beyond the header, digest and dense values."""
    per_row = []
    value_bytes = None
    for server in servers_under(publish):
        for path in sorted(server_dir(publish, server).glob("segment-*.pslog")):
            segment = read_segment(path)
            rows = segment.num_rows
            if rows < 1000:
                continue
            data = path.read_bytes()
            header = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 8], "little")
            payload = len(data) - len(MAGIC) - 8 - header - 32
            dense = sum(v.numel() * 4 for v in segment.dense.values())
            per_row.append((payload - dense) / rows)
            value_bytes = next(iter(segment.tables.values())).values.shape[1] * 4
    return {"bytes_per_row_mean": float(np.mean(per_row)) if per_row else None,
            "goal_bytes_per_row": None if value_bytes is None else 8 + value_bytes,
            "segments_measured": len(per_row)}  # fmt: skip


def torn_reads(job: Any, lookups: int) -> dict[str, Any]:
    served = ServedModel(job.model_fn, 0)
    table = "embeddings.0.weight"
    dim = served.plan.tables[table].dim
    ids = torch.arange(26)
    stop, applied = threading.Event(), [0]

    def versions() -> None:
        while not stop.is_set():
            applied[0] += 1
            n = applied[0]
            made = Segment("bench", 0, n, n - 1, n, n, n - 1, n)
            made.tables[table] = TableChanges(
                ids, torch.full((26, dim), float(n)), torch.zeros(0, dtype=torch.int64)
            )
            served.apply([made])

    writer = threading.Thread(target=versions)
    writer.start()
    torn = 0
    start = time.perf_counter()
    for _ in range(lookups):
        rows, version = served.lookup(table, ids)
        if version.number and not bool((rows == version.number).all()):
            torn += 1
    seconds = time.perf_counter() - start
    stop.set()
    writer.join()
    return {"lookups": lookups, "versions_applied": applied[0], "torn": torn,
            "seconds": seconds, "goal": 0}  # fmt: skip


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(
    port: int, process: subprocess.Popen[bytes], path: str, body: bytes | None = None
) -> None:
    """Until ``port`` answers 200 to a GET of ``path`` (a POST of ``body``, where given)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            headers = {"Content-Type": "application/json"}
            connection.request("GET" if body is None else "POST", path, body, headers)
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"the server on port {port} exited: {process.returncode}")
        time.sleep(0.2)
    raise SystemExit(f"no answer on port {port}")


def timed(call: Any, count: int) -> dict[str, float]:
    seconds = []
    for _ in range(count):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return {"p50_ms": percentile(seconds, 50) * 1e3, "p99_ms": percentile(seconds, 99) * 1e3}


def throughput(call: Any, pid: int, candidates: int, seconds: float) -> dict[str, float]:
    """Predictions from two client threads for ``seconds``: candidates/s, and per CPU-second
    of the serving process ``pid``."""
    done = [0]
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            call()
            done[0] += 1

    cpu = cpu_seconds(pid)
    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    wall, used = time.perf_counter() - start, cpu_seconds(pid) - cpu
    return {"candidates_per_s": done[0] * candidates / wall,
            "candidates_per_cpu_s": done[0] * candidates / used if used else 0.0}  # fmt: skip


def json_caller(port: int, path: str, body: dict[str, Any]) -> Any:
    """A POST of ``body`` as JSON, each client thread on a keep-alive connection of its own."""
    payload = json.dumps(body).encode()
    local = threading.local()

    def call() -> None:
        if not hasattr(local, "connection"):
            local.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        local.connection.request("POST", path, payload, {"Content-Type": "application/json"})
        answer = local.connection.getresponse()
        answer.read()
        assert answer.status == 200

    return call


BASELINE = """
import os, torch
from fastapi import FastAPI
from pydantic import BaseModel
from paramserver.models.dlrm import DLRM
model = DLRM(table_rows=[ROWS] * 8)
model.load_state_dict(torch.load(os.environ["BASELINE_MODEL"], weights_only=True))
model.eval()
app = FastAPI()
class Candidates(BaseModel):
    dense: list[list[float]]
    sparse: list[list[int]]
class Lookup(BaseModel):
    table: int
    ids: list[int]
@app.post("/predict")
def predict(request: Candidates):
    with torch.no_grad():
        return {"scores": model(torch.tensor(request.dense), torch.tensor(request.sparse)).tolist()}
@app.post("/lookup")
def lookup(request: Lookup):
    with torch.no_grad():
        return {"rows": model.embeddings[request.table](torch.tensor(request.ids)).tolist()}
"""


def latency(publish: Path, model_file: Path, rows: int, count: int) -> dict[str, Any]:
    import tritonclient.grpc as triton_grpc
    import tritonclient.http as triton_http

    dense = np.random.default_rng(0).standard_normal((100, 13)).astype(np.float32)
    sparse = np.random.default_rng(1).integers(0, rows, (100, 8)).astype(np.int64)
    ids = np.arange(26, dtype=np.int64) * 7 % rows
    http_port, grpc_port = free_port(), free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "paramserver", "serve", "--follow", str(publish),
         "--http-port", str(http_port), "--grpc-port", str(grpc_port)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    script = Path(tempfile.mkdtemp()) / "baseline.py"
    script.write_text(BASELINE.replace("ROWS", str(rows)))
    base_port = free_port()
    baseline = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--app-dir", str(script.parent), "baseline:app",
         "--host", "127.0.0.1", "--port", str(base_port), "--log-level", "warning"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(REPO), "BASELINE_MODEL": str(model_file)},
    )  # fmt: skip
    try:
        wait_http(http_port, serve, "/v2/health/ready")
        wait_http(base_port, baseline, "/lookup", json.dumps({"table": 0, "ids": [0]}).encode())
        ours: dict[str, Any] = {}
        for name, module, port in (
            ("http", triton_http, http_port),
            ("grpc", triton_grpc, grpc_port),
        ):
            client = module.InferenceServerClient(f"127.0.0.1:{port}")
            lookup = module.InferInput("ids", [26], "INT64")
            lookup.set_data_from_numpy(ids)
            inputs = [module.InferInput("dense", [100, 13], "FP32"),
                      module.InferInput("sparse", [100, 8], "INT64")]  # fmt: skip
            inputs[0].set_data_from_numpy(dense)
            inputs[1].set_data_from_numpy(sparse)
            ours[f"tritonclient_{name}"] = {
                "lookup_26_ids": timed(
                    lambda c=client, x=lookup: c.infer("embeddings.0.weight", [x]), count
                ),
                "predict_100": timed(lambda c=client, x=inputs: c.infer("model", x), count // 4),
            }
        json_lookup = json_caller(
            http_port,
            "/v2/models/embeddings.0.weight/infer",
            {"inputs": [{"name": "ids", "shape": [26], "datatype": "INT64", "data": ids.tolist()}]},
        )
        json_predict = json_caller(
            http_port,
            "/v2/models/model/infer",
            {
                "inputs": [
                    {
                        "name": "dense",
                        "shape": [100, 13],
                        "datatype": "FP32",
                        "data": dense.ravel().tolist(),
                    },
                    {
                        "name": "sparse",
                        "shape": [100, 8],
                        "datatype": "INT64",
                        "data": sparse.ravel().tolist(),
                    },
                ]
            },
        )
        base_lookup = json_caller(base_port, "/lookup", {"table": 0, "ids": ids.tolist()})
        base_predict = json_caller(
            base_port, "/predict", {"dense": dense.tolist(), "sparse": sparse.tolist()}
        )
        ours["plain_http_json"] = {
            "lookup_26_ids": timed(json_lookup, count),
            "predict_100": timed(json_predict, count // 4),
        }
        ours["plain_http_json"]["throughput"] = throughput(json_predict, serve.pid, 100, 10.0)
        client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        grpc_inputs = [triton_grpc.InferInput("dense", [100, 13], "FP32"),
                       triton_grpc.InferInput("sparse", [100, 8], "INT64")]  # fmt: skip
        grpc_inputs[0].set_data_from_numpy(dense)
        grpc_inputs[1].set_data_from_numpy(sparse)
        ours["tritonclient_grpc"]["throughput"] = throughput(
            lambda: client.infer("model", grpc_inputs), serve.pid, 100, 10.0
        )
        fastapi = {"lookup_26_ids": timed(base_lookup, count),
                   "predict_100": timed(base_predict, count // 4),
                   "throughput": throughput(base_predict, baseline.pid, 100, 10.0)}  # fmt: skip
        return {"paramserver_serve": ours, "fastapi_export_baseline": fastapi,
                "goals": {"lookup_p99_ms": 2, "predict_100_p99_ms": 20,
                          "candidates_per_cpu_s": 3000}}  # fmt: skip
    finally:
        for process in (serve, baseline):
            process.kill()
            process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="bench_serve.json")
    parser.add_argument("--pairs", type=int, default=3, help="runs of each side (publishing)")
    parser.add_argument("--lookups", type=int, default=1_000_000, help="torn-read lookups")
    parser.add_argument("--requests", type=int, default=2000, help="latency requests per kind")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, Any] = {"machine": machine()}
    with tempfile.TemporaryDirectory() as scratch:
        figures, publish, model_file, job = follow_a_job(Path(scratch))
        results.update(figures)
        results["segment_bytes"] = segment_bytes(publish)
        rows = build_parser().parse_args(["train"]).rows_per_table
        results["latency"] = latency(publish, model_file, rows, args.requests)
        results["torn_reads"] = torn_reads(job, args.lookups)
        results["publishing"] = publishing_cost(args.pairs, Path(scratch))
    save(results, args.out)


if __name__ == "__main__":
    main()
