"""Serving's HTTP front end while many connections sit idle or trickle (issue 46, item 8),
the old front end and the new side by side in one run.

Each front end serves the default job's initial model (8 tables of 100,000 rows) in a process
of its own, with its default limits (``--http-timeout 30``, ``--http-max-connections``: 64 for
the old, 2048 for the new). A normal client looks up 26 ids of a table as JSON (as
``bench_serve.py``'s ``plain_http_json``) and asks ``GET /v2/health/ready``, first with
nothing else connected (``unloaded``), then while 1,000 idle connections (connected, nothing
sent) and 100 slow ones (a request's head sent a byte every 0.5 s, never whole) are held open
by a third process and reopened whenever the server closes one, as an attacker would
(``loaded``). The client asks both on one keep-alive connection (reopened after a failure)
and on a new connection each time. Per case, rounds of 2,000 lookups (a ready check every
10th): the median round's lookup p50/p99 (ms) and each round's p99 (on a shared machine
others' work lands in a round, not in all), and the answers that were not 200 (a status, or
an error: the connection refused or reset), beside the attack connections open at the start
and the end.

Goals: unloaded lookup p99 <= 2 ms; loaded lookup p99 <= 5 ms and no answer but 200.

The old front end is the standard library's threading server as of :data:`OLD_COMMIT`, read
from git history (``git show``), so it needs this repository's history; ``--fronts new``
measures the new one alone.

    .venv/bin/python benchmarks/bench_serve_load.py --out benchmarks/results/bench_serve_load.json
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import importlib.util
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from report import machine, save

REPO = Path(__file__).resolve().parents[1]
OLD_COMMIT = "963976a348e6cf892bcaab52e31059b052112422"  # the last with the threading server
TABLE = "embeddings.0.weight"
LOOKUP = json.dumps({"inputs": [{"name": "ids", "shape": [26], "datatype": "INT64",
                                 "data": [i * 7 for i in range(26)]}]}).encode()  # fmt: skip
SLOW_HEAD = f"POST /v2/models/{TABLE}/infer HTTP/1.1\r\nContent-Length: 1000\r\n".encode()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else 0.0


# ---- the serving process ----


def old_serving_class(scratch: Path) -> Any:
    """HttpServing of the old front end, its module read from git history."""
    source = subprocess.run(
        ["git", "show", f"{OLD_COMMIT}:paramserver/serving/http.py"], cwd=REPO,
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = scratch / "old_http.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_http", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HttpServing


def serve_child(front: str, record: Path) -> None:
    """Serve the job ``record`` names with front end ``front``; print the port; stop at EOF."""
    sys.path.insert(0, str(REPO))
    from paramserver.cli import recorded_job
    from paramserver.serving.frontend import Frontend
    from paramserver.serving.http import HttpServing
    from paramserver.serving.model import ServedModel

    job = recorded_job(record)
    frontend = Frontend(ServedModel(job.model_fn, job.config.seed), job.example)
    frontend.ready = True
    serving_class = old_serving_class(record.parent) if front == "old" else HttpServing
    serving = serving_class(frontend)
    print(serving.port, flush=True)
    sys.stdin.read()
    serving.close()


def start_serving(front: str, record: Path) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve", front, "--job", str(record)], cwd=REPO,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        raise SystemExit(f"the {front} front end did not start: {process.wait()}")
    return process, int(line)


# ---- the load: idle and slow connections, reopened when closed ----


class Load:
    """``idle`` connections that send nothing and ``slow`` ones trickling a request head a
    byte every ``every_s``, each reopened within a second of the server closing it."""

    def __init__(self, port: int, idle: int, slow: int, every_s: float = 0.5):
        self.port, self.every_s = port, every_s
        self.idle = [self._open() for _ in range(idle)]
        self.slow = [(self._open(), 0) for _ in range(slow)]
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _open(self) -> socket.socket | None:
        try:
            connection = socket.create_connection(("127.0.0.1", self.port), timeout=1)
        except OSError:
            return None
        connection.setblocking(False)
        return connection

    @staticmethod
    def _closed(connection: socket.socket | None) -> bool:
        """Whether the server closed ``connection`` (what it sent, a 503, read and dropped)."""
        if connection is None:
            return True
        try:
            while connection.recv(1 << 16):
                pass
            return True  # b"": the server's end is closed
        except BlockingIOError:
            return False  # nothing to read: still open
        except OSError:
            return True

    def _replace(self, connection: socket.socket | None) -> socket.socket | None:
        if connection is not None:
            connection.close()
        self.reopened += 1
        return self._open()

    def _run(self) -> None:
        next_check = 0.0
        while not self._stop.wait(self.every_s):
            for i, (connection, sent) in enumerate(self.slow):
                if self._closed(connection):
                    self.slow[i] = (self._replace(connection), 0)
                    continue
                with contextlib.suppress(OSError):
                    at = sent % len(SLOW_HEAD)
                    connection.send(SLOW_HEAD[at : at + 1])  # type: ignore[union-attr]
                    self.slow[i] = (connection, sent + 1)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + 1.0
                budget = time.monotonic() + 0.5  # a server that stops accepting: try later
                for i, connection in enumerate(self.idle):
                    if time.monotonic() > budget or self._stop.is_set():
                        break
                    if self._closed(connection):
                        self.idle[i] = self._replace(connection)

    def open_now(self) -> int:
        held = [c for c in self.idle] + [c for c, _ in self.slow]
        return sum(not self._closed(c) for c in held)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for connection in [*self.idle, *(c for c, _ in self.slow)]:
            if connection is not None:
                connection.close()


def load_child(port: int, idle: int, slow: int) -> None:
    """Hold a :class:`Load` on ``port``; each line read from stdin is answered with the
    connections open and reopened; stop at EOF."""
    raise_open_files(idle + slow + 1024)
    load = Load(port, idle, slow)
    for _ in sys.stdin:
        print(load.open_now(), load.reopened, flush=True)
    load.close()


class LoadProcess:
    """A :class:`Load` in a process of its own: its sockets' upkeep never takes this
    process's interpreter lock from the normal client being timed."""

    def __init__(self, port: int, idle: int, slow: int):
        self._process = subprocess.Popen(
            [sys.executable, __file__, "--load", f"{port},{idle},{slow}"], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def counts(self) -> tuple[int, int]:
        """The connections open now, and those reopened so far."""
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write("\n")
        self._process.stdin.flush()
        open_now, reopened = self._process.stdout.readline().split()
        return int(open_now), int(reopened)

    def close(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        self._process.wait(60)


# ---- the normal client ----


def ask(connection: http.client.HTTPConnection, method: str, path: str, body: bytes | None):
    connection.request(method, path, body, {"Content-Type": "application/json"})
    answer = connection.getresponse()
    answer.read()
    return answer.status


def normal_client(port: int, requests: int, keep_alive: bool) -> dict[str, Any]:
    """``requests`` lookups, each followed by a ready check every 10th: their latency and the
    answers not 200, by kind."""
    seconds, not_ok = [], {"lookup": 0, "ready": 0}
    statuses: dict[str, int] = {}
    connection = None
    for i in range(requests):
        for kind, method, path, body in (
            ("lookup", "POST", f"/v2/models/{TABLE}/infer", LOOKUP),
            *([("ready", "GET", "/v2/health/ready", None)] if i % 10 == 0 else []),
        ):
            start = time.perf_counter()
            try:
                if connection is None:
                    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                status = str(ask(connection, method, path, body))
            except (OSError, http.client.HTTPException) as error:
                status = type(error).__name__
            if kind == "lookup":
                seconds.append(time.perf_counter() - start)
            if status != "200":
                not_ok[kind] += 1
                statuses[status] = statuses.get(status, 0) + 1
            if not keep_alive or status != "200":
                connection.close()  # type: ignore[union-attr]
                connection = None
    return {
        "lookups": requests,
        "lookup_p50_ms": percentile(seconds, 50) * 1e3,
        "lookup_p99_ms": percentile(seconds, 99) * 1e3,
        "not_200": not_ok,
        "not_200_by_status": statuses,
    }


def rounds(port: int, args: argparse.Namespace, keep_alive: bool) -> dict[str, Any]:
    """``args.rounds`` runs of the normal client: the median round's figures (by lookup p99:
    others' work on a shared machine lands in one round, not in all), each round's p99, and
    the answers not 200 of all rounds."""
    runs = [normal_client(port, args.requests, keep_alive) for _ in range(args.rounds)]
    median = sorted(runs, key=lambda run: run["lookup_p99_ms"])[len(runs) // 2]
    return {
        **median,
        "lookup_p99_ms_each_round": [run["lookup_p99_ms"] for run in runs],
        "not_200_all_rounds": {
            kind: sum(run["not_200"][kind] for run in runs) for kind in ("lookup", "ready")
        },
    }


def measure(front: str, record: Path, args: argparse.Namespace) -> dict[str, Any]:
    process, port = start_serving(front, record)
    styles = (("keep_alive", True), ("new_connection", False))
    try:
        figures: dict[str, Any] = {"unloaded": {}, "loaded": {}}
        for style, keep_alive in styles:
            normal_client(port, 200, keep_alive)  # warm up
            figures["unloaded"][style] = rounds(port, args, keep_alive)
        load = LoadProcess(port, args.idle, args.slow)
        try:
            time.sleep(args.settle_s)
            figures["loaded"]["attack_connections_open_at_start"] = load.counts()[0]
            for style, keep_alive in styles:
                figures["loaded"][style] = rounds(port, args, keep_alive)
            open_at_end, reopened = load.counts()
            figures["loaded"]["attack_connections_open_at_end"] = open_at_end
            figures["loaded"]["attack_connections_reopened"] = reopened
        finally:
            load.close()
        return figures
    finally:
        assert process.stdin is not None
        process.stdin.close()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


def raise_open_files(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        limit = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="bench_serve_load.json")
    parser.add_argument("--fronts", default="old,new", help="which front ends, in order")
    parser.add_argument("--idle", type=int, default=1000, help="idle connections held")
    parser.add_argument("--slow", type=int, default=100, help="trickling connections held")
    parser.add_argument("--requests", type=int, default=2000, help="lookups per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per case (the median)")
    parser.add_argument("--settle-s", type=float, default=3.0, help="after the load opens")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the serving process's mode
    parser.add_argument("--load", help=argparse.SUPPRESS)  # the load's process: PORT,IDLE,SLOW
    parser.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve_child(args.serve, args.job)
        return
    if args.load:
        load_child(*(int(part) for part in args.load.split(",")))
        return
    results: dict[str, Any] = {
        "machine": machine(),
        "load_average_at_start": os.getloadavg(),  # others' work on the machine, if any
        "load": {"idle": args.idle, "slow": args.slow, "slow_byte_every_s": 0.5},
        "goals": {"unloaded_lookup_p99_ms": 2, "loaded_lookup_p99_ms": 5, "loaded_not_200": 0},
    }
    with tempfile.TemporaryDirectory() as scratch:
        record = Path(scratch) / "job.json"
        record.write_text(json.dumps({"train_argv": [], "cwd": str(REPO)}))
        for front in args.fronts.split(","):
            results[front] = measure(front, record, args)
    if "old" in results and "new" in results:
        results["new_over_old"] = {
            f"{load}_{style}_lookup_p99": results["new"][load][style]["lookup_p99_ms"]
            / max(results["old"][load][style]["lookup_p99_ms"], 1e-9)
            for load in ("unloaded", "loaded")
            for style in ("keep_alive", "new_connection")
        }
    save(results, args.out)


if __name__ == "__main__":
    main()
