"""Scale benchmark: one dynamic table of 100 million rows x dim 16, row-wise Adagrad, 2 servers.

The trainer first fills the table (batches of fresh ids covering the whole id space, 65,536 ids
a step), then trains on Zipf-distributed ids (exponent 1.1) drawn over the same id space. Ids
are 64-bit hashes (SplitMix64 of the rank). Reported per server: peak resident memory, rows,
memory per row, lookups/s and updates/s (rows over the time the server spent reading and
updating); and the job's samples/s in the fill and training phases (from progress events).

    .venv/bin/python benchmarks/bench_100m.py --out benchmarks/results/bench_100m.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from report import save
from torch import Tensor, nn

import paramserver as ps
from paramserver.hashing import mix64
from paramserver.types import Progress

IDS_PER_SAMPLE = 8
DIM = 16


class HashedFeatures(nn.Module):
    """Eight hashed categorical features sharing one dynamic table, summed, then an MLP."""

    def __init__(self, capacity_per_server: int) -> None:
        super().__init__()
        self.table = ps.DynamicEmbedding(DIM, mode="sum", capacity=capacity_per_server)
        self.mlp = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: Tensor) -> Tensor:
        return self.mlp(self.table(ids)).squeeze(1)


def zipf_ranks(count: int, space: int, exponent: float, g: torch.Generator) -> Tensor:
    """Continuous inverse-CDF Zipf sampling over ranks [0, space)."""
    u = torch.rand(count, generator=g, dtype=torch.float64)
    tail = space ** (1 - exponent)
    x = (1 - u * (1 - tail)) ** (1 / (1 - exponent))
    return (x.floor().long() - 1).clamp_(0, space - 1)


def make_data(rows: int, fill_batch: int, train_steps: int, train_batch: int) -> Any:
    fill_steps = -(-rows // (fill_batch * IDS_PER_SAMPLE))

    def data(trainer: int, num_trainers: int) -> Iterator[tuple[Tensor, Tensor]]:
        g = torch.Generator().manual_seed(trainer)
        per_step = fill_batch * IDS_PER_SAMPLE
        for step in range(fill_steps):
            ranks = torch.arange(step * per_step, min(rows, (step + 1) * per_step))
            ranks = torch.cat([ranks, ranks[: (-ranks.numel()) % IDS_PER_SAMPLE]])  # full rows
            ids = mix64(ranks).view(-1, IDS_PER_SAMPLE)
            yield ids, torch.rand(ids.shape[0], generator=g).round()
        for _ in range(train_steps):
            ranks = zipf_ranks(train_batch * IDS_PER_SAMPLE, rows, 1.1, g)
            ids = mix64(ranks).view(train_batch, IDS_PER_SAMPLE)
            yield ids, torch.rand(train_batch, generator=g).round()

    return data, fill_steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=100_000_000)
    parser.add_argument("--fill-batch", type=int, default=8192)
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--train-batch", type=int, default=2048)
    parser.add_argument("--out", default="bench_100m.json")
    args = parser.parse_args()

    data, fill_steps = make_data(args.rows, args.fill_batch, args.train_steps, args.train_batch)
    capacity = int(args.rows / 2 * 1.02)  # per server; buckets split the ids about evenly
    events: list[tuple[float, Progress]] = []
    config = ps.TrainConfig(
        servers=2,
        trainers=1,
        mode="async",
        optimizer="adagrad",
        lr=0.05,
        table_optimizer="rowwise_adagrad",
        table_lr=0.05,
        progress=False,
        rpc_timeout=600.0,
        gather_model=False,  # 6.4 GB of rows: more than one process should gather
    )
    started = time.perf_counter()
    result = ps.train(
        lambda: HashedFeatures(capacity),
        data,
        lambda out, y: F.binary_cross_entropy_with_logits(out, y),
        config,
        on_progress=lambda p: events.append((time.perf_counter(), p)),
    )
    assert result is not None
    wall = time.perf_counter() - started
    fill_end = next((t, p) for t, p in events if p.steps >= fill_steps)
    last_t, last = events[-1]
    servers = []
    for stats in result.summary["server_stats"]:
        servers.append(
            {
                "max_rss_bytes": stats["max_rss_bytes"],
                "lookups_per_s": stats["rows_pulled"] / max(stats["read_seconds"], 1e-9),
                "updates_per_s": stats["rows_updated"] / max(stats["update_seconds"], 1e-9),
            }
        )
    table_stats = result.summary["tables"]["table.weight"]
    report = {
        "rows": table_stats["rows"],
        "memory_bytes_total": table_stats["memory_bytes"],
        "memory_bytes_per_row": table_stats["memory_bytes"] / table_stats["rows"],
        "id_map_bytes_per_row": table_stats["id_map_bytes"] / table_stats["rows"],
        "servers": servers,
        "fill": {  # from the first step's end (start-up excluded) to the fill's end
            "steps": fill_steps,
            "seconds": fill_end[0] - events[0][0],
            "rows_per_s": (fill_end[1].samples - events[0][1].samples)
            * IDS_PER_SAMPLE
            / max(fill_end[0] - events[0][0], 1e-9),
        },
        "train": {
            "steps": last.steps - fill_end[1].steps,
            "samples_per_s": (last.samples - fill_end[1].samples) / max(last_t - fill_end[0], 1e-9),
        },
        "wall_s": wall,
        "summary": {k: v for k, v in result.summary.items() if k != "server_stats"},
    }
    save(report, args.out)


if __name__ == "__main__":
    main()
