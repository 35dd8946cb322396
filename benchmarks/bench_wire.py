"""A Criteo step's call on the wire, with and without bundles: round trips between two processes
over paramserver's RPC transport (TensorPipe on loopback), side by side in one run.

The request is shaped as a Criteo job's (``bench_criteo.py``): 26 dynamic tables, each pushing
the gradients of ``--rows`` rows of 16 and pulling as many ids, and a DLRM's 8 dense gradients;
the answer brings the 26 tables' rows and the 8 dense values. The server's side answers at once
(no table work), so a round trip is the two messages' way there and back: serialising, TensorPipe,
deserialising.

- ``bundled``: as paramserver sends them: each mapping of tensors as one
  (:class:`paramserver.wire.bundles.Bundle`), about 8 tensors a round trip;
- ``per_tensor``: every tensor on its own (bundling turned off in both processes), ~150.

Reported per variant: the median round trip (wall) and the caller's CPU time to send (the
serialisation and TensorPipe's part in the calling thread), over ``--calls`` calls in blocks
that alternate between the variants; and the ratios per_tensor / bundled.

    .venv/bin/python benchmarks/bench_wire.py --out benchmarks/results/bench_wire.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from report import machine, save
from torch.futures import Future

from paramserver.futures import completed
from paramserver.transport import rpc
from paramserver.wire import messages
from paramserver.wire.messages import PushPullReply, PushPullRequest, RowBlock

TABLES = 26
DIM = 16
DENSE_SHAPES = [(64, 13), (64,), (16, 64), (16,), (64, 367), (64,), (1, 64), (1,)]
_BUNDLED = messages.bundled


def set_bundling(on: bool) -> None:
    messages.bundled = _BUNDLED if on else (lambda mapping: mapping)


class Answering:
    """The server's side: answers a request with rows for its pulled ids and the dense values,
    bundled or not as the operation's name says."""

    def __init__(self, rows: int):
        g = torch.Generator().manual_seed(1)
        self.dense = {f"dense{i}": torch.randn(s, generator=g) for i, s in enumerate(DENSE_SHAPES)}
        self.rows = {f"t{i}": torch.randn(rows, DIM, generator=g) for i in range(TABLES)}

    def handle(self, op: object, args: object) -> Future:
        set_bundling(op == "bundled")
        return completed(PushPullReply(dense=dict(self.dense), rows=dict(self.rows)))


def request(rows: int) -> PushPullRequest:
    g = torch.Generator().manual_seed(0)
    ids = {f"t{i}": torch.randint(-(2**62), 2**62, (rows,), generator=g) for i in range(TABLES)}
    return PushPullRequest(
        trainer=0,
        call=1,
        dense_grads={f"dense{i}": torch.randn(s, generator=g) for i, s in enumerate(DENSE_SHAPES)},
        row_grads={t: RowBlock(i, torch.randn(rows, DIM, generator=g)) for t, i in ids.items()},
        pull_rows={t: i.clone() for t, i in ids.items()},
    )


def run_rank(rank: int, init_file: str, args: argparse.Namespace, results: Any) -> None:
    torch.set_num_threads(1)
    name = rpc.server_name(0) if rank == 0 else rpc.trainer_name(0)
    rpc.expose(Answering(args.rows) if rank == 0 else None)
    rpc.start(name, rank, 2, init_method=f"file://{init_file}", num_threads=4, timeout_s=60,
              loopback_only=True)  # fmt: skip
    if rank == 1:
        results.update(measure(rpc.RpcTransport(1, 60.0), request(args.rows), args.calls))
    rpc.stop()


def measure(transport: rpc.RpcTransport, message: PushPullRequest, calls: int) -> dict[str, Any]:
    times: dict[str, dict[str, list[float]]] = {
        v: {"round_trip_ms": [], "send_cpu_ms": []} for v in ("bundled", "per_tensor")
    }
    for block in range(2 * calls // 50):
        variant = "bundled" if block % 2 == 0 else "per_tensor"
        set_bundling(variant == "bundled")
        for _ in range(50):
            started, cpu = time.perf_counter(), time.thread_time()
            answer = transport.call(0, variant, message)
            sent = time.thread_time()
            answer.wait()
            times[variant]["round_trip_ms"].append(1e3 * (time.perf_counter() - started))
            times[variant]["send_cpu_ms"].append(1e3 * (sent - cpu))
    medians = {v: {k: statistics.median(x) for k, x in t.items()} for v, t in times.items()}
    return {
        "median": medians,
        "per_tensor_vs_bundled": {
            k: medians["per_tensor"][k] / medians["bundled"][k] for k in medians["bundled"]
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=250, help="rows per table and call")
    parser.add_argument("--calls", type=int, default=400, help="per variant")
    parser.add_argument("--out", default="bench_wire.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work, mp.Manager() as manager:
        results = manager.dict()
        init_file = str(Path(work) / "rendezvous")
        mp.spawn(run_rank, args=(init_file, args, results), nprocs=2)
        measured = dict(results)
    tensors = {"request_tensors_per_tensor": TABLES * 3 + len(DENSE_SHAPES)}
    tensors["answer_tensors_per_tensor"] = TABLES + len(DENSE_SHAPES)
    save({"machine": machine(), "rows": args.rows, "tables": TABLES, **tensors, **measured},
         args.out)  # fmt: skip


if __name__ == "__main__":
    main()
