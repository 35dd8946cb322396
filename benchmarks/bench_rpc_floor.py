"""What one round trip costs its caller, before paramserver does anything: the floor under a step.

Two processes on loopback, one torch thread each; the caller sends a message and waits for the
echo, over and over. Reported: the caller's process CPU per round trip (every thread: TensorPipe's
too) and its wall time, for

- ``rpc_empty``: ``torch.distributed.rpc`` (TensorPipe, as paramserver configures it) carrying
  nothing;
- ``rpc_tensors``: carrying a small step's tensors as they are (ids, rows, two dense values);
- ``rpc_frame``: carrying the same as one frame of bytes (``paramserver.wire.frames``, as the RPC
  transport sends every call);
- ``socket_frame``: the same frame over a plain loopback TCP socket (length-prefixed), what a
  transport of paramserver's own would pay.

    .venv/bin/python benchmarks/bench_rpc_floor.py --out benchmarks/results/bench_rpc_floor.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import struct
import time
from typing import Any

import torch
import torch.distributed.rpc as rpc
from report import machine, save
from systems import run_isolated

from paramserver.wire import frames

_LENGTH = struct.Struct("<Q")


def echo(message: Any) -> Any:
    return message


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


def rpc_rank(rank: int, port: int, calls: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TP_SOCKET_IFNAME="lo")
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=4, _transports=["uv"], _channels=["basic"]
    )
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    figures: dict[str, Any] = {}
    if rank == 0:
        tensors = step_message()
        frame = frames.encode(tensors)
        for name, message in (("rpc_empty", None), ("rpc_tensors", tensors)):
            figures[name] = timed(lambda m=message: rpc.rpc_async("w1", echo, (m,)).wait(), calls)
        figures["rpc_frame"] = timed(
            lambda: frames.decode(rpc.rpc_async("w1", echo, (frames.encode(tensors),)).wait()),
            calls,
        )
        figures["frame_bytes"] = len(frame)
    rpc.shutdown()
    return figures


def _receive(connection: socket.socket) -> bytes:
    head = connection.recv(_LENGTH.size, socket.MSG_WAITALL)
    if not head:
        return b""
    return connection.recv(_LENGTH.unpack(head)[0], socket.MSG_WAITALL)


def socket_rank(rank: int, port: int, calls: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    if rank == 1:
        with socket.create_server(("127.0.0.1", port)) as server:
            connection, _ = server.accept()
            with connection:
                while frame := _receive(connection):
                    connection.sendall(_LENGTH.pack(len(frame)) + frame)
        return {}
    deadline = time.monotonic() + 30
    while True:
        try:
            connection = socket.create_connection(("127.0.0.1", port))
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    tensors = step_message()

    def round_trip() -> None:
        frame = frames.encode(tensors)
        connection.sendall(_LENGTH.pack(len(frame)) + frame)
        frames.decode(_receive(connection))

    with connection:
        return {"socket_frame": timed(round_trip, calls)}


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
    args = parser.parse_args()
    figures: dict[str, Any] = {}
    for rank_fn in (rpc_rank, socket_rank):
        port = free_port()
        caller, _ = run_isolated(rank_fn, [(0, port, args.calls), (1, port, args.calls)], 300)
        figures.update(caller)
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
