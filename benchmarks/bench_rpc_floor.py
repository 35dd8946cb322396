"""What one round trip costs its caller, before paramserver does anything: the floor under a step.

Two processes on loopback, one torch thread each; the caller sends a message and waits for the
echo, over and over. Reported: the caller's process CPU per round trip (every thread: TensorPipe's
too) and its wall time, for

- ``rpc_empty``: ``torch.distributed.rpc`` (TensorPipe, as paramserver configures it) carrying
  nothing;
- ``rpc_tensors``: carrying a small step's tensors as they are (ids, rows, two dense values);
- ``rpc_frame``: carrying the same as one frame of bytes (``paramserver.wire.frames``, as the RPC
  transport sends every call);
- ``data_socket``: the same call over the socket paramserver's data calls take
  (:mod:`paramserver.transport.sockets`: a frame and a header each way, answers read on the
  connection's own thread).

With ``--instructions`` (needs valgrind), the caller's instructions per round trip too, counted by
cachegrind over its whole process (every thread), as ``bench_step_instructions.py`` counts a
trainer's step: the difference between a run of ``--calls // 10`` round trips more and a run of
``--calls // 100``, over the extra ones. The host's other tenants do not move it, but TensorPipe's
threads poll, so the RPC kinds' counts move between runs (by up to a third here).

    .venv/bin/python benchmarks/bench_rpc_floor.py --instructions \
        --out benchmarks/results/bench_rpc_floor.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.rpc as rpc
from report import machine, save
from systems import run_isolated
from torch.futures import Future

from paramserver.futures import completed
from paramserver.transport.sockets import FrameConnection, FrameListener
from paramserver.wire import frames


def echo(message: Any) -> Any:
    return message


def echo_frame(frame: bytearray, large: list[torch.Tensor]) -> tuple[bytearray, list[torch.Tensor]]:
    """A frame's echo, taken and answered as the RPC transport's calls are."""
    return frame, large


def step_message() -> tuple[Any, ...]:
    """A small step's payload: 32 ids, their 32 x 16 rows, a 16 x 16 weight and its bias."""
    return (torch.arange(32), torch.randn(32, 16), torch.randn(16, 16), torch.randn(16))


def timed(round_trip: Any, calls: int) -> dict[str, float]:
    for _ in range(calls // 10):  # warm up
        round_trip()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        round_trip()
    return {
        "caller_cpu_us": 1e6 * (time.process_time() - cpu) / calls,
        "wall_us": 1e6 * (time.perf_counter() - wall) / calls,
    }


def _rpc_round_trips() -> dict[str, Any]:
    """Each RPC kind's round trip, as a function of no arguments (in the caller, once the RPC
    world is up)."""
    tensors = step_message()
    return {
        "rpc_empty": lambda: rpc.rpc_async("w1", echo, (None,)).wait(),
        "rpc_tensors": lambda: rpc.rpc_async("w1", echo, (tensors,)).wait(),
        "rpc_frame": lambda: frames.decode(
            *rpc.rpc_async("w1", echo_frame, frames.encode(tensors)).wait()
        ),
    }


def _init_rpc(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TP_SOCKET_IFNAME="lo")
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=4, _transports=["uv"], _channels=["basic"]
    )
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)


def rpc_rank(rank: int, port: int, calls: int) -> dict[str, Any]:
    _init_rpc(rank, port)
    figures: dict[str, Any] = {}
    if rank == 0:
        for name, round_trip in _rpc_round_trips().items():
            figures[name] = timed(round_trip, calls)
        figures["frame_bytes"] = len(frames.encode(step_message())[0])
    rpc.shutdown()
    return figures


COUNTED_KINDS = ("rpc_empty", "rpc_tensors", "rpc_frame", "data_socket")


def counted_rank(rank: int, port: int, kind: str, calls: int) -> dict[str, Any]:
    """``calls`` round trips of ``kind`` (rank 0 runs under valgrind: see ``--instructions``;
    the socket's too)."""
    if kind == "data_socket":
        return socket_rank(rank, port, calls, warm_up=False)
    _init_rpc(rank, port)
    if rank == 0:
        round_trip = _rpc_round_trips()[kind]
        for _ in range(calls):
            round_trip()
    rpc.shutdown()
    return {}


_COUNT = re.compile(r"^summary:\s+(\d+)", re.MULTILINE)


def caller_instructions(kind: str, calls: int) -> int:
    """The whole caller process's instructions in a run of ``calls`` round trips of ``kind``."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="rpc-floor-") as work:
        out_file = Path(work) / "caller.cachegrind"
        command = [sys.executable, __file__, "--counted-rank", kind, str(calls), str(port)]
        single = dict.fromkeys(("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"), "1")
        env = {**os.environ, **single, "PYTHONHASHSEED": "0"}
        valgrind = ["valgrind", "--tool=cachegrind", "--cache-sim=no"]
        caller = subprocess.Popen(
            [*valgrind, f"--cachegrind-out-file={out_file}", *command, "0"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        echoer = subprocess.Popen([*command, "1"], env=env, stdout=subprocess.DEVNULL)
        try:
            _, errors = caller.communicate(timeout=1200)
            echoer.wait(timeout=60)
        finally:
            for process in (caller, echoer):
                if process.poll() is None:
                    process.kill()
        found = _COUNT.search(out_file.read_text()) if out_file.exists() else None
        if caller.returncode != 0 or found is None:
            raise SystemExit(f"the counted caller failed:\n{errors.decode()[-3000:]}")
        return int(found.group(1))


def instructions_per_round_trip(calls: int) -> dict[str, float]:
    base = max(calls // 10, 1)
    return {
        kind: (caller_instructions(kind, base + calls) - caller_instructions(kind, base)) / calls
        for kind in COUNTED_KINDS
    }


class _EchoEndpoint:
    """Answers every call with its arguments, until a ``stop`` call."""

    def __init__(self) -> None:
        self.stopped = threading.Event()

    def handle(self, op: object, args: object) -> Future:
        if op == "stop":
            self.stopped.set()
        return completed(args)


def socket_rank(rank: int, port: int, calls: int, warm_up: bool = True) -> dict[str, Any]:
    """``data_socket``: rank 1 serves a :class:`~paramserver.transport.sockets.FrameListener`,
    rank 0 calls it through a ``FrameConnection``, as a trainer's data calls go."""
    torch.set_num_threads(1)
    if rank == 1:
        endpoint = _EchoEndpoint()
        listener = FrameListener(endpoint, "127.0.0.1", 1 << 30, port=port)
        endpoint.stopped.wait(timeout=600)
        listener.close()
        return {}
    deadline = time.monotonic() + 30
    while True:
        try:
            connection = FrameConnection(("127.0.0.1", port), 30.0)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    tensors = step_message()

    def lost(cause: str, timed_out: bool) -> BaseException:
        return RuntimeError(cause)

    def round_trip() -> None:
        connection.call("echo", tensors, 60.0, lost).wait()

    try:
        if not warm_up:  # counted: exactly ``calls`` round trips
            for _ in range(calls):
                round_trip()
            return {}
        return {"data_socket": timed(round_trip, calls)}
    finally:
        connection.call("stop", (), 60.0, lost).wait()
        connection.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=3000, help="round trips per kind")
    parser.add_argument("--out", default="bench_rpc_floor.json")
    parser.add_argument(
        "--instructions", action="store_true", help="count the caller's instructions too"
    )
    parser.add_argument("--counted-rank", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.counted_rank is not None:
        kind, calls, port, rank = args.counted_rank
        counted_rank(int(rank), int(port), kind, int(calls))
        return
    if args.instructions and shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (apt install valgrind)")
    figures: dict[str, Any] = {}
    for rank_fn in (rpc_rank, socket_rank):
        port = free_port()
        caller, _ = run_isolated(rank_fn, [(0, port, args.calls), (1, port, args.calls)], 300)
        figures.update(caller)
    if args.instructions:
        figures["caller_instructions"] = instructions_per_round_trip(args.calls // 10)
    save(
        {
            "benchmark": "bench_rpc_floor",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": machine(),
            "calls": args.calls,
            "round_trips": figures,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
