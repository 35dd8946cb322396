"""A Criteo step's call on the wire, as one frame and as tensors: round trips between two
processes over TensorPipe on loopback, side by side in one run.

The request is shaped as a Criteo job's (``bench_criteo.py``): 26 dynamic tables, each pushing
the gradients of ``--rows`` rows of 16 and pulling as many ids, and a DLRM's 8 dense gradients;
the answer brings the 26 tables' rows and the 8 dense values. The server's side answers at once
(no table work), so a round trip is the two messages' way there and back: serialising, TensorPipe,
deserialising.

- ``framed``: as paramserver's RPC transport sends them: each message one frame of bytes
  (:mod:`paramserver.wire.frames`);
- ``pickled_by_torch``: the same messages handed to ``torch.distributed.rpc`` as they are,
  pickled by torch's pickler, each of their mappings of tensors bundled into one tensor
  (:mod:`paramserver.wire.bundles`) and each tensor a TensorPipe buffer (about 8 a round trip).

Reported per variant: the median round trip (wall) and the caller's process CPU per round trip
(every thread: TensorPipe's too), over ``--calls`` calls in blocks that alternate between the
variants; and the ratios pickled_by_torch / framed.

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
import torch.distributed.rpc as torch_rpc
import torch.multiprocessing as mp
from report import machine, save
from torch.futures import Future

from paramserver.futures import completed
from paramserver.transport import rpc
from paramserver.wire.messages import PushPullReply, PushPullRequest, RowBlock

TABLES = 26
DIM = 16
DENSE_SHAPES = [(64, 13), (64,), (16, 64), (16,), (64, 367), (64,), (1, 64), (1,)]


class Answering:
    """The server's side: answers a request with rows for its pulled ids and the dense values."""

    def __init__(self, rows: int):
        g = torch.Generator().manual_seed(1)
        self.dense = {f"dense{i}": torch.randn(s, generator=g) for i, s in enumerate(DENSE_SHAPES)}
        self.rows = {f"t{i}": torch.randn(rows, DIM, generator=g) for i in range(TABLES)}

    def reply(self) -> PushPullReply:
        return PushPullReply(dense=dict(self.dense), rows=dict(self.rows))

    def handle(self, op: object, args: object) -> Future:
        return completed(self.reply())


_ANSWERING: Answering | None = None


def answer_pickled_by_torch(message: PushPullRequest) -> PushPullReply:
    """The pickled_by_torch variant's server side: torch RPC calls it with the request as it is."""
    assert _ANSWERING is not None
    return _ANSWERING.reply()


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
    global _ANSWERING
    name = rpc.server_name(0) if rank == 0 else rpc.trainer_name(0)
    _ANSWERING = Answering(args.rows) if rank == 0 else None
    rpc.expose(_ANSWERING)
    rpc.start(name, rank, 2, init_method=f"file://{init_file}", num_threads=4, timeout_s=60,
              loopback_only=True)  # fmt: skip
    if rank == 1:
        results.update(measure(rpc.RpcTransport(1, 60.0), request(args.rows), args.calls))
    rpc.stop()


def measure(transport: rpc.RpcTransport, message: PushPullRequest, calls: int) -> dict[str, Any]:
    times: dict[str, dict[str, list[float]]] = {
        v: {"round_trip_ms": [], "cpu_ms": []} for v in ("framed", "pickled_by_torch")
    }
    server = rpc.server_name(0)
    for block in range(2 * calls // 50):
        variant = "framed" if block % 2 == 0 else "pickled_by_torch"
        for _ in range(50):
            started, cpu = time.perf_counter(), time.process_time()
            if variant == "framed":
                transport.call(0, "push_pull", message).wait()
            else:
                torch_rpc.rpc_async(server, answer_pickled_by_torch, (message,)).wait()
            times[variant]["round_trip_ms"].append(1e3 * (time.perf_counter() - started))
            times[variant]["cpu_ms"].append(1e3 * (time.process_time() - cpu))
    medians = {v: {k: statistics.median(x) for k, x in t.items()} for v, t in times.items()}
    return {
        "median": medians,
        "pickled_by_torch_vs_framed": {
            k: medians["pickled_by_torch"][k] / medians["framed"][k] for k in medians["framed"]
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
    save({"machine": machine(), "rows": args.rows, "tables": TABLES, **measured}, args.out)


if __name__ == "__main__":
    main()
