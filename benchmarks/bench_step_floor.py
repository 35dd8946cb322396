"""The least a parameter server's training step can cost its trainer in Python: a floor for the
one-table model's figures (``bench_field.py``'s ``tiny``: one ``nn.Embedding`` of 1,000 x 16, a
linear layer, batch 32, SGD), side by side with what one process and paramserver pay.

- ``plain_forward_backward``: one process's forward and backward alone;
- ``plain_step``: one process's whole step (forward, backward, ``torch.optim.SGD``'s step and
  zeroing its gradients);
- ``bare_ps``: a bare parameter server of two processes on loopback: each step the trainer
  looks up the pulled rows, runs forward and backward, and in one round trip sends its batch's
  row gradients and dense gradients with the next batch's unique ids, and waits for their rows
  and the dense values. Messages are a fixed header and the arrays' bytes (one ``sendmsg``, two
  ``recv_into``); the server applies SGD with ``index_add_``. Nothing is checked, measured,
  kept for recovery or overlapped with compute: no real system does less per step.
- ``paramserver``: the chief trainer of a 1 server + 1 trainer async job
  (``bench_field.trainer_loop_cpu``).

Reported per step: the trainer's process CPU (its every thread) and that beyond
``plain_forward_backward``; with ``--instructions`` (needs valgrind) also the instructions of
``plain_forward_backward``, ``plain_step`` and ``bare_ps``'s trainer, counted by cachegrind as
``bench_step_instructions.py`` counts (the difference between a run of ``--steps`` more steps and
one of ``--base-steps``, over the extra steps; paramserver's own count is that script's).

    .venv/bin/python benchmarks/bench_step_floor.py --instructions \\
        --out benchmarks/results/bench_step_floor.json
"""

from __future__ import annotations

import argparse
import datetime
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from bench_field import trainer_loop_cpu
from bench_step_instructions import counted, environment, valgrind_command
from field_models import DIM, Workload
from report import machine, save
from systems import run_isolated
from torch import Tensor

ROWS, BATCH, LR = 1_000, 32, 0.1
_HEAD = struct.Struct("<qq")  # a message's two counts (see _server and _BareTrainer)
Batches = list[tuple[Tensor, Tensor]]
Step = Callable[[int], None]  # runs the step of the batch of that number


def _batches(steps: int) -> Batches:
    return list(Workload("tiny", BATCH, steps).batches(0, 1))


def _received(sock: socket.socket, buffer: bytearray, nbytes: int) -> memoryview:
    view, at = memoryview(buffer)[:nbytes], 0
    while at < nbytes:
        got = sock.recv_into(view[at:], nbytes - at, socket.MSG_WAITALL)
        if got == 0:
            raise EOFError
        at += got
    return view


def _array(data: memoryview, dtype: type, count: int, offset: int) -> Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype, count, offset))


def _server(port: int) -> None:
    """The bare server: a call is (ids n, next ids m) then n ids, their n row gradients, the
    dense gradients and m ids; it applies SGD and answers m rows and the dense values."""
    torch.set_num_threads(1)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        table, dense = torch.randn(ROWS, DIM), torch.zeros(DIM + 1)
        buffer = bytearray(1 << 20)
        while True:
            try:
                n, m = _HEAD.unpack(_received(sock, buffer, _HEAD.size))
            except EOFError:
                return
            data = _received(sock, buffer, n * 8 + n * DIM * 4 + (DIM + 1) * 4 + m * 8)
            ids = _array(data, np.int64, n, 0)
            grads = _array(data, np.float32, n * DIM, n * 8).view(n, DIM)
            dense.sub_(_array(data, np.float32, DIM + 1, n * 8 + n * DIM * 4), alpha=LR)
            table.index_add_(0, ids, grads, alpha=-LR)
            asked = _array(data, np.int64, m, n * 8 + n * DIM * 4 + (DIM + 1) * 4)
            sock.sendmsg([_HEAD.pack(m, 0), table[asked].numpy(), dense.numpy()])


class _BareTrainer:
    def __init__(self, sock: socket.socket):
        self.sock, self.buffer = sock, bytearray(1 << 20)

    def round_trip(
        self, ids: Tensor, grads: Tensor, dense: Tensor, asked: Tensor
    ) -> tuple[Tensor, Tensor]:
        head = _HEAD.pack(ids.numel(), asked.numel())
        self.sock.sendmsg([head, ids.numpy(), grads.numpy(), dense.numpy(), asked.numpy()])
        m, _ = _HEAD.unpack(_received(self.sock, self.buffer, _HEAD.size))
        data = _received(self.sock, self.buffer, m * DIM * 4 + (DIM + 1) * 4)
        rows = _array(data, np.float32, m * DIM, 0).view(m, DIM).clone()
        return rows, _array(data, np.float32, DIM + 1, m * DIM * 4).clone()

    def train(self, batches: Batches) -> Step:
        no_ids, no_rows = torch.empty(0, dtype=torch.int64), torch.empty(0, DIM)
        ids, inverse = torch.unique(batches[0][0], return_inverse=True)
        rows, dense = self.round_trip(no_ids, no_rows, torch.zeros(DIM + 1), ids)

        def step(i: int) -> None:
            nonlocal ids, inverse, rows, dense
            target = batches[i][1]
            leaf = rows.requires_grad_(True)
            weight = dense[:DIM].view(1, DIM).requires_grad_(True)
            bias = dense[DIM:].requires_grad_(True)
            output = F.linear(F.embedding(inverse, leaf), weight, bias).squeeze(1)
            F.binary_cross_entropy_with_logits(output, target).backward()
            assert leaf.grad is not None and weight.grad is not None and bias.grad is not None
            dense_grads = torch.cat([weight.grad.view(-1), bias.grad])
            next_ids, next_inverse = torch.unique(batches[i + 1][0], return_inverse=True)
            rows, dense = self.round_trip(ids, leaf.grad, dense_grads, next_ids)
            ids, inverse = next_ids, next_inverse

        return step


def _plain(optimize: bool) -> Callable[[Batches], Step]:
    def prepare(batches: Batches) -> Step:
        model = Workload("tiny", BATCH, 1).model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)

        def step(i: int) -> None:
            ids, target = batches[i]
            F.binary_cross_entropy_with_logits(model(ids), target).backward()
            if optimize:
                optimizer.step()
                optimizer.zero_grad()

        return step

    return prepare


def _with_bare_server(run: Callable[[_BareTrainer], Any]) -> Any:
    """``run`` of a trainer connected to a bare server of its own (a process it started; it
    ends once the trainer's connection closes, else is killed)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = str(listener.getsockname()[1])
        server = subprocess.Popen([sys.executable, __file__, "--serve", port])
        try:
            listener.settimeout(60.0)
            sock, _ = listener.accept()
            with sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return run(_BareTrainer(sock))
        finally:
            try:
                server.wait(timeout=30.0)
            except subprocess.TimeoutExpired:
                server.kill()


def _stepped(kind: str, steps: int) -> dict[str, float]:
    """``kind``'s ``steps`` steps in this process: the process CPU per step over the last nine
    tenths (the first warm up)."""
    torch.set_num_threads(1)
    batches = _batches(steps + 1)

    def run(prepare: Callable[[Batches], Step]) -> dict[str, float]:
        step = prepare(batches)
        warm = steps // 10
        for i in range(warm):
            step(i)
        cpu = time.process_time()
        for i in range(warm, steps):
            step(i)
        return {"cpu_per_step_s": (time.process_time() - cpu) / (steps - warm)}

    if kind == "bare_ps":
        return _with_bare_server(lambda trainer: run(trainer.train))
    return run(_plain(optimize=kind == "plain_step"))


KINDS = ("plain_forward_backward", "plain_step", "bare_ps")


def instructions(kind: str, steps: int) -> int:
    """``kind``'s process instructions over ``steps`` steps (the bare server's not counted)."""
    with tempfile.TemporaryDirectory(prefix="step-floor-") as work:
        out_file = Path(work) / "counted.cachegrind"
        command = [sys.executable, __file__, "--worker", kind, str(steps)]
        here = Path(__file__).resolve().parent.parent
        done = subprocess.run(
            [*valgrind_command(out_file), *command], env=environment(here), capture_output=True
        )
        if done.returncode != 0:
            raise SystemExit(f"{kind} failed under valgrind:\n{done.stderr.decode()[-3000:]}")
        return counted(out_file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000, help="steps of each timed run")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs; medians")
    parser.add_argument("--instructions", action="store_true", help="count them too (valgrind)")
    parser.add_argument("--base-steps", type=int, default=100)
    parser.add_argument("--counted-steps", type=int, default=1_000, help="extra steps counted")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "STEPS"), help=argparse.SUPPRESS)
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="bench_step_floor.json")
    args = parser.parse_args()
    if args.serve:
        _server(args.serve)
        return
    if args.worker:
        _stepped(args.worker[0], int(args.worker[1]))
        return
    cpu: dict[str, list[float]] = {kind: [] for kind in (*KINDS, "paramserver")}
    for repeat in range(args.repeats):  # alternate which runs first
        order = list(cpu) if repeat % 2 == 0 else list(cpu)[::-1]
        for kind in order:
            if kind == "paramserver":
                workload = Workload("tiny", BATCH, args.steps)
                result = run_isolated(trainer_loop_cpu, [(workload,)], args.timeout)[0]
            else:
                result = run_isolated(_stepped, [(kind, args.steps)], args.timeout)[0]
            cpu[kind].append(1e6 * result["cpu_per_step_s"])
    medians = {kind: statistics.median(figures) for kind, figures in cpu.items()}
    base = medians["plain_forward_backward"]
    entries: dict[str, Any] = {
        kind: {"cpu_us": medians[kind], "cpu_us_beyond_forward_backward": medians[kind] - base,
               "runs": cpu[kind]}
        for kind in cpu
    }  # fmt: skip
    if args.instructions:
        for kind in KINDS:
            extra = args.counted_steps
            more, fewer = (instructions(kind, args.base_steps + n) for n in (extra, 0))
            entries[kind]["instructions"] = (more - fewer) / extra
        plain = entries["plain_forward_backward"]["instructions"]
        for kind in KINDS:
            entries[kind]["instructions_beyond_forward_backward"] = (
                entries[kind]["instructions"] - plain
            )
    save(
        {
            "benchmark": "bench_step_floor",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": machine(),
            "steps": args.steps,
            "repeats": args.repeats,
            "entries": entries,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
