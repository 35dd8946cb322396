"""Online training from a Redis stream, measured against the same work on files, with a real
redis-server on loopback (started here, on a free port, and stopped by its pid).

- ``ingest``: one trainer's reader (:class:`paramserver.streams.RedisStreamReader`: XREADGROUP,
  hiredis, the block parse, batches by count) over ``--records`` synthetic Criteo lines, against
  the file reader's parsing path (``CriteoFiles.train_batches``) over a file of the same lines,
  alternating. Goal: >= 200k records/s per trainer and >= 0.8x the file path.
- ``train``: the Criteo job (2 servers, 2 trainers, processes launcher, async, ``--steps``)
  on the stream against the same job on the file, alternating; samples/s and CPU seconds per
  1000 samples. Goal: >= 0.9x.
- ``freshness``: the README's online loop (a producer at ``--rate``, ``train --publish-dir``,
  ``serve --follow``): ``--probes`` times, an event with a C1 value never seen is written and
  its served row polled until it changes. Goal: p50 <= 3 s.
- ``kills``: a sync job (2 servers, 1 trainer, Adam, each record's number in C26) SIGKILLed
  ``--trials`` times each in a trainer and in a server at a random moment after its first
  checkpoint, restarted by ``--max-restarts 1`` from that checkpoint, and in a server of a job
  with ``--recover`` (only that server restarts, from its change log); every record must be
  trained on once (C26's per-row step counts) and the final checkpoint must equal an
  uninterrupted run's over the same records, bitwise.

    .venv/bin/python benchmarks/bench_stream.py --out benchmarks/results/bench_stream.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
from report import machine, save

from paramserver.checkpoint import load_latest
from paramserver.checkpoint.store import committed_steps
from paramserver.data.criteo import NUM_CATEGORICAL, CriteoFiles, hash_categorical
from paramserver.streams import RedisStream
from paramserver.streams.produce import produce, synthetic_lines

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RECORD_TABLE = f"embeddings.{NUM_CATEGORICAL - 1}.weight"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Redis:
    def __init__(self, directory: Path):
        self.port = free_port()
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(directory)],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while True:
            try:
                RedisStream("127.0.0.1", self.port, "x").connect().ping()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def url(self, stream: str) -> str:
        return f"redis://127.0.0.1:{self.port}/{stream}"

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# ---- ingestion -------------------------------------------------------------------------------


def ingest(redis: Redis, scratch: Path, records: int, pairs: int) -> dict[str, Any]:
    path = scratch / "lines.txt"
    path.write_bytes(b"\n".join(synthetic_lines(records)) + b"\n")
    runs: dict[str, list[float]] = {"redis": [], "file": []}
    for pair in range(pairs):
        source = RedisStream.from_url(redis.url(f"ingest-{pair}"), batch_size=512)
        source.check()
        produce(source, iter(path.read_bytes().splitlines()))
        started = time.perf_counter()
        reader, seen = source(0, 1), 0
        while seen < records - 512:
            seen += len(next(reader)[1])
        runs["redis"].append(seen / (time.perf_counter() - started))
        reader.close()
        started = time.perf_counter()
        seen = sum(len(labels) for _, labels in CriteoFiles([path], 512).train_batches(0, 1))
        runs["file"].append(seen / (time.perf_counter() - started))
        print("ingest", {k: round(v[-1]) for k, v in runs.items()}, flush=True)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "records": records,
        "records_per_s": runs,
        "median_records_per_s": medians,
        "redis_vs_file": medians["redis"] / medians["file"],
    }


# ---- training --------------------------------------------------------------------------------


def run_train(dataset: str, steps: int, scratch: Path, *flags: str) -> dict[str, float]:
    summary = scratch / "summary.json"
    argv = [str(BIN / "paramserver"), "train", "--dataset", dataset, "--steps", str(steps)]
    argv += ["--no-progress", "--summary-json", str(summary), *flags]
    cpu = children_cpu_s()
    done = subprocess.run(argv, cwd=scratch, capture_output=True, text=True, timeout=900)
    cpu = children_cpu_s() - cpu
    if done.returncode != 0:
        raise SystemExit(f"{dataset} failed:\n{done.stderr[-3000:]}")
    figures = json.loads(summary.read_text())
    return {
        "samples_per_s": float(figures["samples_per_s"]),
        "cpu_s_per_1000_samples": 1000 * cpu / float(figures["samples"]),
    }


def train(redis: Redis, scratch: Path, steps: int, pairs: int) -> dict[str, Any]:
    records = steps * 2 * 512 + 50_000
    path = scratch / "train.txt"
    path.write_bytes(b"\n".join(synthetic_lines(records, seed=1)) + b"\n")
    runs: dict[str, list[dict[str, float]]] = {"stream": [], "files": []}
    for pair in range(pairs):
        source = RedisStream.from_url(redis.url(f"train-{pair}"))
        produce(source, iter(path.read_bytes().splitlines()))
        runs["stream"].append(run_train(f"stream:{source.name}", steps, scratch))
        runs["files"].append(run_train(f"criteo:{path}", steps, scratch))
        print("train", {k: v[-1] for k, v in runs.items()}, flush=True)
    medians = {
        k: {key: statistics.median(r[key] for r in v) for key in v[0]} for k, v in runs.items()
    }
    ratio = medians["stream"]["samples_per_s"] / medians["files"]["samples_per_s"]
    return {"steps": steps, "runs": runs, "medians": medians, "stream_vs_files": ratio}


# ---- freshness -------------------------------------------------------------------------------


def served_row(http: int, row_id: int) -> list[float]:
    body = {"inputs": [{"name": "ids", "shape": [1], "datatype": "INT64", "data": [row_id]}]}
    url = f"http://127.0.0.1:{http}/v2/models/embeddings.0.weight/infer"
    with urllib.request.urlopen(url, json.dumps(body).encode(), timeout=10) as answer:
        return list(json.loads(answer.read())["outputs"][0]["data"])


def wait_ready(http: int, deadline_s: float = 90) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready") as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("serve never became ready")


def started(argv: list[str], cwd: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv, cwd=cwd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def stopped(*processes: subprocess.Popen[bytes]) -> None:
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def freshness(redis: Redis, scratch: Path, probes: int, rate: float) -> dict[str, Any]:
    source = RedisStream.from_url(redis.url("events"))
    http, grpc = free_port(), free_port()
    producer = started(
        [sys.executable, "-m", "paramserver.streams.produce", source.name, "--records", "0",
         "--rate", str(rate)], scratch,
    )  # fmt: skip
    trainer = started(
        [str(BIN / "paramserver"), "train", "--dataset", f"stream:{source.name}",
         "--publish-dir", "live", "--publish-every", "1", "--no-progress"], scratch,
    )  # fmt: skip
    try:
        while not (scratch / "live" / "job.json").exists():
            time.sleep(0.1)
        server = started(
            [str(BIN / "paramserver"), "serve", "--follow", "live", "--http-port", str(http),
             "--grpc-port", str(grpc)], scratch,
        )  # fmt: skip
        try:
            wait_ready(http)
            seconds = [probe(source, http, 0xC0FFEE + i) for i in range(probes)]
        finally:
            stopped(server)
    finally:
        stopped(producer, trainer)
    quantiles = statistics.quantiles(seconds, n=100, method="inclusive")
    return {
        "rate": rate,
        "probes": probes,
        "seconds": seconds,
        "p50_s": statistics.median(seconds),
        "p99_s": quantiles[98],
    }


def probe(source: RedisStream, http: int, value: int) -> float:
    """Seconds from an event with C1 = ``value`` written to its row served changed."""
    categorical = torch.zeros(1, NUM_CATEGORICAL, dtype=torch.int64)
    categorical[0, 0] = value
    row_id = int(hash_categorical(categorical)[0, 0])
    before = served_row(http, row_id)
    fields = next(synthetic_lines(1, seed=value)).split(b"\t")
    fields[14] = b"%x" % value
    source.connect().xadd(source.stream, {"line": b"\t".join(fields)})
    written = time.monotonic()
    while served_row(http, row_id) == before:
        if time.monotonic() - written > 60:
            raise SystemExit(f"the row of C1={value:x} never changed")
        time.sleep(0.02)
    return time.monotonic() - written


# ---- kills -----------------------------------------------------------------------------------

KILL_STEPS = 120


def kill_job(url: str, root: Path, *flags: str) -> subprocess.Popen[str]:
    argv = [str(BIN / "paramserver"), "train", "--dataset", f"stream:{url}", "--mode", "sync"]
    argv += ["--trainers", "1", "--optimizer", "adam", "--batch-size", "128", "--no-progress"]
    argv += ["--checkpoint-dir", str(root / "ckd"), "--checkpoint-every", "20"]
    argv += ["--steps", str(KILL_STEPS), *flags]
    return subprocess.Popen(
        argv, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def final_state(root: Path) -> dict[str, torch.Tensor]:
    found = load_latest(root / "ckd")
    assert found is not None and found.meta.get("final")
    state = {}
    for server in (0, 1):
        tensors, _ = found.read_part(f"server-{server}")
        state.update({f"{server}/{name}": t for name, t in tensors.items()})
    return state


def worker_pid(launcher: int, rank: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        module = b"paramserver.launch.worker"
        if parent == launcher and module in argv and argv[argv.index(module) + 2] == b"%d" % rank:
            return int(entry.name)
    return None


def workers_of(launcher: int) -> list[int]:
    """Worker processes of that launcher still alive (by the launcher pid in their environment)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and b"PARAMSERVER_LAUNCHER_PID=%d\0" % launcher in (entry / "environ").read_bytes()
            ):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def kill_trial(redis: Redis, scratch: Path, lines: list[bytes], kind: str, rng: random.Random,
               reference: dict[str, torch.Tensor] | None) -> dict[str, Any]:  # fmt: skip
    root = Path(tempfile.mkdtemp(dir=scratch))
    source = RedisStream.from_url(redis.url(root.name))
    produce(source, iter(lines))
    flags = ["--max-restarts", "1"] if kind != "none" else []
    if kind == "server_recover":  # only the killed server restarts, from its log
        flags += ["--publish-dir", str(root / "log"), "--recover"]
    job = kill_job(source.name, root, *flags)
    killed_at = None
    if kind != "none":
        while not committed_steps(root / "ckd") and job.poll() is None:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))
        pid = worker_pid(job.pid, 2 if kind == "trainer" else rng.randrange(2))
        if kind == "server_recover":  # after its log has a segment or two
            time.sleep(1.5)
        if pid is not None and job.poll() is None:
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
    output, _ = job.communicate(timeout=600)
    left = workers_of(job.pid)
    result: dict[str, Any] = {"kind": kind, "exit": job.returncode, "killed": killed_at is not None}
    result["restarted"] = "restarting the job" in output or "restarting it alone" in output
    if job.returncode == 0:
        state = final_state(root)
        steps = state[f"0/table/{RECORD_TABLE}/steps"].tolist()
        steps += state[f"1/table/{RECORD_TABLE}/steps"].tolist()
        result["records_trained"] = len(steps)
        result["trained_twice"] = sum(s > 1 for s in steps)
        result["all_records"] = len(steps) == KILL_STEPS * 128
        if reference is not None:
            result["bitwise_equal"] = state.keys() == reference.keys() and all(
                torch.equal(state[k], reference[k]) for k in state
            )
        result["state"] = state
    result["processes_left"] = len(left)
    shutil.rmtree(root, ignore_errors=True)
    return result


def kills(redis: Redis, scratch: Path, trials: int, kinds: list[str]) -> dict[str, Any]:
    numbered = list(synthetic_lines(KILL_STEPS * 128 + 2000, seed=5, record_ids=True))
    reference = kill_trial(redis, scratch, numbered, "none", random.Random(0), None)
    assert reference["exit"] == 0, reference
    figures: dict[str, Any] = {}
    for kind in kinds:
        rng = random.Random(kind)
        runs = []
        for _ in range(trials):
            run = kill_trial(redis, scratch, numbered, kind, rng, reference["state"])
            run.pop("state", None)
            print("kill", run, flush=True)
            runs.append(run)
        figures[kind] = {
            "trials": trials,
            "finished": sum(r["exit"] == 0 for r in runs),
            "killed": sum(r["killed"] for r in runs),
            "exactly_once": sum(
                r.get("all_records", False) and not r["trained_twice"] for r in runs
            ),
            "bitwise_equal": sum(bool(r.get("bitwise_equal")) for r in runs),
            "processes_left": sum(r["processes_left"] for r in runs),
            "runs": runs,
        }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="ingest,train,freshness,kills")
    parser.add_argument("--records", type=int, default=500_000)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--probes", type=int, default=20)
    parser.add_argument("--rate", type=float, default=5000)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--kill-kinds", default="trainer,server,server_recover")
    parser.add_argument("--out", default="bench_stream.json")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is needed: apt-get install redis-server")
    parts = args.parts.split(",")
    results: dict[str, Any] = {"machine": machine()}
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        redis = Redis(scratch)
        try:
            if "ingest" in parts:
                results["ingest"] = ingest(redis, scratch, args.records, args.pairs)
            if "train" in parts:
                results["train"] = train(redis, scratch, args.steps, args.pairs)
            if "freshness" in parts:
                results["freshness"] = freshness(redis, scratch, args.probes, args.rate)
            if "kills" in parts:
                results["kills"] = kills(redis, scratch, args.trials, args.kill_kinds.split(","))
        finally:
            redis.stop()
    save(results, args.out)


if __name__ == "__main__":
    main()
