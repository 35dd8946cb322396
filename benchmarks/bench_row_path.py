"""What each step of one row's trip costs: the trainer's client and the server's request path,
timed step by step in one process, at the core benchmark's sizes (DLRM, 8 tables of 1M rows x
32, batch 1024, Zipf ids, one server, async, one torch thread).

Each step runs on the same requests a training step sends (the ids of real synthetic batches
and gradients of their shape), ``--calls`` times; the figure is the median per call and per
pulled row (one call carries a step's rows of all 8 tables), in CPU time of the calling thread
(every step runs in it: the figures hold on a loaded machine, where wall time would not).
Steps, in a row's order:

- ``client.push_pull``: route gradients and ids to servers, encode, measure, send (a transport
  that answers at once with a prepared reply: the client's own time only);
- ``server.check_size`` .. ``server.read``: :class:`ServerShard`'s steps on the request the
  client sent (``apply`` and ``read`` on the same rows each time: warm caches);
- ``server.push_pull``: the coordinator's whole path (check, decode, admit, apply, answer);
- ``client.wait``: reassemble the answer in the caller's order.

With ``--tables dynamic`` the model's tables are dynamic: the first call creates the rows, the
steps after it read and update rows that exist. Its ``server.apply`` names no pull (as a sync
round's sum does), so each table looks its ids up again; in ``server.push_pull`` (async) a
push finds its rows in its pull's record.

Usage: ``.venv/bin/python benchmarks/bench_row_path.py [--calls 200] [--codec int8]
[--tables dynamic] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from report import machine, save
from torch import Tensor
from torch.futures import Future

import paramserver as ps
from paramserver.data.synthetic import SyntheticClickLogs, SyntheticSpec
from paramserver.launch.roles import build_server
from paramserver.modelplan import plan_of
from paramserver.models.dlrm import DLRM
from paramserver.trainer.client import PSClient, PushCodecs
from paramserver.transport.base import Transport
from paramserver.wire.messages import PushPullReply, PushPullRequest
from paramserver.wire.sizing import clone_message

ROWS, DIM, BATCH, TABLES = 1_000_000, 32, 1024, 8


def dlrm(dynamic: bool = False) -> DLRM:
    return DLRM(table_rows=[ROWS] * TABLES, embedding_dim=DIM, dynamic_tables=dynamic)


class AnswerAtOnce(Transport):
    """Answers every call with ``reply`` and keeps the last request, so a client's time is
    measured alone and a server can be given what a client sends."""

    def __init__(self, reply: PushPullReply):
        self.num_servers = 1
        self.reply = reply
        self.sent: PushPullRequest | None = None

    def call(self, server: int, op: str, *args: Any, timeout_s: float | None = None) -> Future:
        self.sent = args[0]
        answer: Future = Future()
        answer.set_result(self.reply)
        return answer


def median_us(fn: Callable[[], Any], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e6


def step_ids(data: SyntheticClickLogs, step: int) -> dict[str, Tensor]:
    """The sorted unique ids of each table that batch ``step`` looks up."""
    batches = data.train_batches(0, 1)
    for _ in range(step):
        next(batches)
    (_, sparse), _ = next(batches)
    return {f"embeddings.{t}.weight": torch.unique(sparse[:, t]) for t in range(TABLES)}


def run(calls: int, codec: str, tables: str = "fixed") -> dict[str, Any]:
    torch.set_num_threads(1)
    config = ps.TrainConfig(
        servers=1,
        trainers=1,
        mode="async",
        optimizer="adagrad",
        lr=0.05,
        dense_push_codec=codec,
        table_push_codec=codec,
        table_pull_codec=codec,
    )
    model_fn = functools.partial(dlrm, tables == "dynamic")
    endpoint = build_server(0, config, model_fn)
    coordinator = endpoint.coordinator  # type: ignore[attr-defined]
    shard = coordinator.shard
    plan = plan_of(model_fn(), 1)
    data = SyntheticClickLogs(SyntheticSpec(rows_per_table=ROWS, batch_size=BATCH))
    ids = step_ids(data, 0)
    rows = sum(t.numel() for t in ids.values())
    dense = {name: torch.randn(spec.shape) * 1e-3 for name, spec in plan.dense.items()}
    row_grads = {name: torch.randn(t.numel(), DIM) * 1e-3 for name, t in ids.items()}

    # The client, as a trainer drives it: wait for a step's rows, push their gradients with
    # the next pull (of the same ids: each step's answer is the same prepared reply).
    reply = coordinator.push_pull(PushPullRequest(0, 0, pull_rows=dict(ids))).wait()
    transport = AnswerAtOnce(reply)
    client = PSClient(transport, plan, 0, codecs=PushCodecs.of(config.sections.codecs, plan.tables))
    building, waiting = [], []
    pending = client.push_pull({}, {}, ids)
    for _ in range(calls):
        start = time.thread_time()
        pulled = pending.wait()
        waiting.append(time.thread_time() - start)
        grads = {name: (pulled.rows[name][0], g) for name, g in row_grads.items()}
        start = time.thread_time()
        pending = client.push_pull(dense, grads, ids, grads_call=pulled.call)
        building.append(time.thread_time() - start)
    figures = {
        "client.push_pull": statistics.median(building) * 1e6,
        "client.wait": statistics.median(waiting) * 1e6,
    }

    # The server, given what the client sent, renumbered as the trainer's next calls.
    sent = transport.sent
    assert sent is not None

    def request(call: int) -> PushPullRequest:
        return replace(clone_message(sent), call=call, grads_call=call - 1)

    cap = coordinator.max_message_bytes
    prepared = [request(1) for _ in range(calls)]
    checks = shard.checks
    figures["server.check_size"] = median_us(lambda: checks.check_size(prepared[0], cap), calls)
    queue = iter(prepared)
    figures["server.decode_request"] = median_us(lambda: checks.decode_request(next(queue)), calls)
    figures["server.validate"] = median_us(lambda: checks.validate(prepared[0]), calls)
    figures["server.apply"] = median_us(
        lambda: shard.apply(prepared[0].dense_grads, prepared[0].row_grads, 1), calls
    )
    figures["server.read"] = median_us(lambda: shard.read(prepared[0], train=True, clock=1), calls)
    steps = iter(range(1, 1 + calls))
    figures["server.push_pull"] = median_us(
        lambda: coordinator.push_pull(request(next(steps))).wait(), calls
    )
    coordinator.close()
    return {
        "machine": machine(),
        "codec": codec,
        "tables": tables,
        "rows_per_call": rows,
        "calls": calls,
        "us_per_call": {k: round(v, 1) for k, v in figures.items()},
        "ns_per_row": {k: round(v * 1e3 / rows, 1) for k, v in figures.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls timed per step")
    parser.add_argument(
        "--codec", default="none", help="codec of every push and of pulled rows (int8, ...)"
    )
    parser.add_argument(
        "--tables", default="fixed", choices=("fixed", "dynamic"), help="the model's tables"
    )
    parser.add_argument("--out", default="bench_row_path.json")
    args = parser.parse_args()
    save(run(args.calls, args.codec, args.tables), args.out)


if __name__ == "__main__":
    main()
