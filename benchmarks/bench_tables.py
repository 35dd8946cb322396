"""Embedding-table benchmarks: the id map, memory per row, server-side pooling, dynamic tables.

Writes JSON (``--out``); each comparison runs side by side in one run:

- ``id_map``: inserts/s, lookups/s and bytes per row of the dynamic tables' id map at
  ``--id-map-rows`` rows (one thread).
- ``memory_per_row``: a dynamic table (dim 16) filled with 2M rows for each update rule: bytes
  per row for rows + optimizer state + bookkeeping, against 1.25 x (row + state bytes), and the
  id map's bytes per row.
- ``pooling``: an EmbeddingBag table (1M x 32, sum) with bags of 20-40 Zipf-distributed ids,
  1 server + 1 trainer, async: trainer-side pooling against server-side pooling (bytes per
  step and samples/s).
- ``dynamic_vs_fixed``: the core benchmark's model (8 tables x 1M x 32, batch 1024) with fixed
  tables and with dynamic tables, 1 server + 1 trainer, async, ``--repeats`` alternating runs
  of each: samples/s and the ratio of medians (and of bests), and beside them the CPU per
  sample of the trainer and of the server, counted over the training steps (Linux only).
- ``server_cpu``: the same model's server work alone, in this process on one thread (the
  thread's CPU time, far less noisy than throughput here): per step, on a first pass over the
  data (dynamic tables create rows for 40% of the ids; the fastest of three, each on a new
  server) and on the fastest of three more (every row exists). New rows per second two
  ways: rows made over the whole filling pass's CPU (``fill_new_rows_per_s``, reads and updates
  of existing rows included), and over what filling costs beyond the warm pass
  (``new_rows_per_extra_s``: the cost of making a row alone).

    .venv/bin/python benchmarks/bench_tables.py --out benchmarks/results/bench_tables.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from report import save
from torch import Tensor, nn

import paramserver as ps
from paramserver.data.synthetic import SyntheticClickLogs, SyntheticSpec
from paramserver.embedding import DynamicOptions
from paramserver.launch.roles import build_server
from paramserver.models.dlrm import DLRM
from paramserver.optim import make_rule
from paramserver.optimconfig import OptimizerConfig
from paramserver.sharding import TableSpec
from paramserver.store.dynamic import DynamicTable
from paramserver.store.idmap import IdMap
from paramserver.store.table import Reading
from paramserver.wire.idcodec import PackedIds
from paramserver.wire.messages import PushPullRequest, RowBlock


def bench_id_map(rows: int) -> dict[str, float]:
    torch.set_num_threads(1)
    ids = torch.randint(-(2**62), 2**62, (rows,), generator=torch.Generator().manual_seed(0))
    id_map = IdMap()
    started = time.perf_counter()
    for chunk in ids.split(65536):
        id_map.insert(chunk.unique())
    insert_s = time.perf_counter() - started
    queries = ids[torch.randint(0, rows, (rows,))]
    started = time.perf_counter()
    for chunk in queries.split(65536):
        id_map.lookup(chunk)
    lookup_s = time.perf_counter() - started
    return {
        "rows": id_map.num_rows,
        "inserts_per_s": id_map.num_rows / insert_s,
        "lookups_per_s": rows / lookup_s,
        "bytes_per_row": id_map.nbytes() / id_map.num_rows,
    }


def bench_memory_per_row(rows: int) -> dict[str, Any]:
    slot_bytes = {"sgd": 0, "adagrad": 64, "rowwise_adagrad": 4, "adam": 128}
    results = {}
    for name, state_bytes in slot_bytes.items():
        spec = TableSpec("t", 0, 16, torch.float32, dynamic=DynamicOptions())
        table = DynamicTable(spec, make_rule(OptimizerConfig(name=name, lr=0.1)))
        ids = torch.randint(-(2**62), 2**62, (rows,)).unique()
        for step, chunk in enumerate(ids.split(65536)):
            table.read(chunk, Reading(train=True, clock=step))
        id_map = table.ids.nbytes() + table.pending.nbytes()
        live = table.stats()["rows"]
        results[name] = {
            "rows": live,
            "bytes_per_row": (table.nbytes() - id_map) / live,
            "bound_bytes_per_row": 1.25 * (64 + state_bytes),
            "id_map_bytes_per_row": table.ids.nbytes() / live,
        }
    return results


class BagModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(1_000_000, 32, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids: Tensor, offsets: Tensor) -> Tensor:
        return self.mlp(self.bag(ids, offsets)).squeeze(1)


def long_bags(batches: int) -> Any:
    cdf = (torch.arange(1, 1_000_001, dtype=torch.float64) ** -1.05).cumsum(0)
    cdf = (cdf / cdf[-1]).float()

    def data(trainer: int, num_trainers: int) -> Iterator[Any]:
        g = torch.Generator().manual_seed(trainer)
        for _ in range(batches):
            lengths = torch.randint(20, 41, (512,), generator=g)
            ids = torch.searchsorted(cdf, torch.rand(int(lengths.sum()), generator=g))
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
            yield (ids.clamp_(max=999_999), offsets), torch.rand(512, generator=g).round()

    return data


def job_figures(result: ps.TrainResult | None) -> dict[str, Any]:
    assert result is not None
    summary = result.summary
    return {
        "samples_per_s": summary["samples_per_s"],
        "bytes_per_step": summary["bytes_per_step"],
        "seconds": summary["train_seconds"],
    }


def bench_pooling(steps: int) -> dict[str, Any]:
    config = ps.TrainConfig(servers=1, trainers=1, optimizer="adagrad", lr=0.05, progress=False)
    data = long_bags(steps)
    trainer_side = job_figures(ps.train(BagModel, data, F.binary_cross_entropy_with_logits, config))
    server_side = job_figures(
        ps.train(
            BagModel,
            data,
            F.binary_cross_entropy_with_logits,
            config.replace(server_pooling=("bag.weight",)),
        )
    )
    return {
        "trainer_side": trainer_side,
        "server_side": server_side,
        "pull_bytes_ratio": server_side["bytes_per_step"]["pull"]
        / trainer_side["bytes_per_step"]["pull"],
        "push_bytes_ratio": server_side["bytes_per_step"]["push"]
        / trainer_side["bytes_per_step"]["push"],
        "speed_ratio": server_side["samples_per_s"] / trainer_side["samples_per_s"],
    }


def bench_dynamic_vs_fixed(steps: int, repeats: int) -> dict[str, Any]:
    """Samples/s of the core model with fixed and with dynamic tables, and beside it the CPU
    per sample of the job's processes (trainer, server) over the training steps only: the
    second moves far less with the host's other tenants than the first."""
    config = ps.TrainConfig(servers=1, trainers=1, optimizer="adagrad", lr=0.05, progress=False)
    data = SyntheticClickLogs(
        SyntheticSpec(rows_per_table=1_000_000, batch_size=1024, train_batches=steps)
    )
    runs: dict[str, list[dict[str, Any]]] = {"fixed": [], "dynamic": []}
    for _ in range(repeats):  # alternate, so drifting load hits both alike
        for kind in runs:
            model_fn = (
                (lambda: DLRM(table_rows=[1_000_000] * 8, embedding_dim=32, dynamic_tables=True))
                if kind == "dynamic"
                else (lambda: DLRM(table_rows=[1_000_000] * 8, embedding_dim=32))
            )
            result = ps.run(model_fn, cpu_counted_loop(data.train_batches), config)
            runs[kind].append(job_figures(result) | cpu_figures(result))
    best = {k: max(r["samples_per_s"] for r in v) for k, v in runs.items()}
    median = {k: statistics.median(r["samples_per_s"] for r in v) for k, v in runs.items()}
    cpu = {
        k: {
            part: statistics.median(r["cpu_us_per_sample"][part] for r in v)
            for part in ("trainer", "server", "job")
        }
        for k, v in runs.items()
    }
    return {
        "runs": runs,
        "best_samples_per_s": best,
        "median_samples_per_s": median,
        "median_cpu_us_per_sample": cpu,
        "dynamic_vs_fixed": median["dynamic"] / median["fixed"],
        "dynamic_vs_fixed_best": best["dynamic"] / best["fixed"],
        # Samples per CPU second, dynamic over fixed: the speed ratio a host with no other
        # tenants would show where the job is CPU-bound.
        "dynamic_vs_fixed_cpu": cpu["fixed"]["job"] / cpu["dynamic"]["job"],
    }


def cpu_counted_loop(data_fn: Any) -> Any:
    """``paramserver.train``'s loop (one trainer: every batch, ``ctx.step`` after each
    backward) that also returns the CPU seconds of this trainer's process and of the job's
    other workers (its siblings: the local launcher's children) from its first step to its
    last, and the samples trained meanwhile. Linux only (``/proc``)."""

    def loop(ctx: ps.TrainContext) -> dict[str, float]:
        started: dict[int, float] = {}
        samples = 0
        for inputs, target in ctx.batches(data_fn(ctx.rank, ctx.num_trainers)):
            if not started:  # the first step's batch is here: count from now on
                started = {pid: process_cpu_s(pid) for pid in sibling_pids()}
            else:
                samples += int(target.shape[0])  # this batch's, trained after the first
            loss = F.binary_cross_entropy_with_logits(ctx.model(*inputs), target)
            loss.backward()
            ctx.step(loss.detach(), samples=int(target.shape[0]))
        used = {pid: process_cpu_s(pid) - cpu for pid, cpu in started.items()}
        trainer = used.pop(os.getpid())
        return {"samples": samples, "trainer_cpu_s": trainer, "server_cpu_s": sum(used.values())}

    return loop


def sibling_pids() -> list[int]:
    """This process and the others its parent started (a local job's workers)."""
    parent = Path(f"/proc/{os.getppid()}/task")
    children = [(task / "children").read_text().split() for task in parent.iterdir()]
    return sorted({int(pid) for each in children for pid in each})


def process_cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_figures(result: ps.TrainResult | None) -> dict[str, Any]:
    assert result is not None
    counted = result.value
    per_sample = {
        "trainer": counted["trainer_cpu_s"],
        "server": counted["server_cpu_s"],
        "job": counted["trainer_cpu_s"] + counted["server_cpu_s"],
    }
    return {"cpu_us_per_sample": {k: 1e6 * v / counted["samples"] for k, v in per_sample.items()}}


def bench_server_cpu(steps: int) -> dict[str, Any]:
    """Server CPU seconds per step for the dynamic_vs_fixed model, in this process, one thread:
    the exact calls a trainer makes, over the data once (dynamic tables create their rows) and
    again (every row exists). Rows per second of server CPU: those read and updated in a warm
    step (each pulled row is also updated, from the step before), and, for dynamic tables,
    those made while filling (over the whole filling pass, reads of existing rows included).

    Each figure is the fastest of three passes, the one least slowed by the host's other
    tenants: three warm passes on one server, and for dynamic tables three filling passes,
    each on a new server (a fixed table's filling pass makes nothing: one)."""
    torch.set_num_threads(1)
    config = ps.TrainConfig(servers=1, trainers=1, optimizer="adagrad", lr=0.05, progress=False)
    data = SyntheticClickLogs(
        SyntheticSpec(rows_per_table=1_000_000, batch_size=1024, train_batches=steps)
    )
    batches = [inputs[1] for inputs, _ in data.train_batches(0, 1)]
    # Each step's sorted unique ids per table, as a trainer sends them: made before timing
    # (they are the trainer's work, not the server's).
    step_ids = [[sparse[:, t].unique() for t in range(8)] for sparse in batches]
    rows_per_pass = sum(ids.numel() for each in step_ids for ids in each)
    results: dict[str, Any] = {}
    for kind in ("fixed", "dynamic"):
        more_fills = 2 if kind == "dynamic" else 0  # each makes the same rows
        fills = [_server_passes(config, kind, step_ids, 1)[0][0] for _ in range(more_fills)]
        passes, held = _server_passes(config, kind, step_ids, 4)
        made = held if kind == "dynamic" else 0
        fill, warm = min([passes[0], *fills]), min(passes[1:])
        results[kind] = {
            "fill_ms_per_step": 1e3 * fill,
            "warm_ms_per_step": 1e3 * warm,
            "fill_passes_ms_per_step": [1e3 * each for each in [passes[0], *fills]],
            "warm_passes_ms_per_step": [1e3 * each for each in passes[1:]],
            # A warm step reads and updates rows that exist; a filling one also makes rows.
            "warm_rows_per_s": rows_per_pass / (warm * len(batches)),
            "fill_new_rows_per_s": made / (fill * len(batches)) if made else None,
            # What making rows adds: the filling pass's CPU over the warm pass's (the same
            # reads and updates), per row made.
            "new_rows_per_extra_s": made / ((fill - warm) * len(batches)) if made else None,
        }
    results["dynamic_vs_fixed_cpu"] = {
        phase: results["dynamic"][phase] / results["fixed"][phase]
        for phase in ("fill_ms_per_step", "warm_ms_per_step")
    }
    return results


def _server_passes(
    config: ps.TrainConfig, kind: str, step_ids: list[list[Tensor]], passes: int
) -> tuple[list[float], int]:
    """Thread CPU seconds per step of ``passes`` passes over ``step_ids`` on a new server of
    the dynamic_vs_fixed model with ``kind`` tables, and the rows its tables hold then."""
    model = DLRM(table_rows=[1_000_000] * 8, embedding_dim=32, dynamic_tables=kind == "dynamic")
    endpoint = build_server(0, config, lambda: model)
    names = sorted(endpoint.shard.store.tables)
    dense = {n: torch.full_like(s.value, 1e-3) for n, s in endpoint.shard.store.dense.items()}
    # Each step's gradients, made before timing too (a trainer's work).
    grads = [[torch.full((i.numel(), 32), 0.01) for i in table_ids] for table_ids in step_ids]
    step, seconds = 0, []
    for _ in range(passes):
        previous: dict[str, RowBlock] = {}
        started = time.thread_time()
        for table_ids, table_grads in zip(step_ids, grads, strict=True):
            pulled: dict[str, Tensor | PackedIds] = dict(zip(names, table_ids, strict=True))
            request = PushPullRequest(0, step, pull_rows=pulled, grads_call=step - 1)
            if previous:
                request.row_grads = previous
                request.dense_grads = dict(dense)
            endpoint.coordinator.push_pull(request).wait()
            together = zip(names, table_ids, table_grads, strict=True)
            previous = {name: RowBlock(ids, grad) for name, ids, grad in together}
            step += 1
        seconds.append((time.thread_time() - started) / len(step_ids))
    made = sum(t.stats()["rows"] for t in endpoint.shard.store.tables.values())
    endpoint.coordinator.close()
    return seconds, made


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--id-map-rows", type=int, default=10_000_000)
    parser.add_argument("--memory-rows", type=int, default=2_000_000)
    parser.add_argument("--pooling-steps", type=int, default=100)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--only",
        default="id_map,memory_per_row,pooling,dynamic_vs_fixed,server_cpu",
        help="parts to run",
    )
    parser.add_argument("--out", default="bench_tables.json")
    args = parser.parse_args()
    parts = {
        "id_map": lambda: bench_id_map(args.id_map_rows),
        "memory_per_row": lambda: bench_memory_per_row(args.memory_rows),
        "pooling": lambda: bench_pooling(args.pooling_steps),
        "dynamic_vs_fixed": lambda: bench_dynamic_vs_fixed(args.steps, args.repeats),
        "server_cpu": lambda: bench_server_cpu(args.steps),
    }
    results = {name: parts[name]() for name in args.only.split(",")}
    save(results, args.out)


if __name__ == "__main__":
    main()
