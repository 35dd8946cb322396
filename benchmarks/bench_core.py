"""Core benchmark: paramserver against single-process PyTorch and a naive parameter server.

Workload: the default job's DLRM architecture with 8 tables of 1M rows x 32, batch 1024,
Zipf-distributed ids, Adagrad everywhere, one torch thread per process. Runs, side by side in
one run:

- ``single_process``: plain PyTorch, sparse embedding gradients, torch.optim.Adagrad;
- ``paramserver``: 1 server + 1 trainer processes, async;
- ``naive_ps``: the textbook design (1 server; the whole model pulled and every gradient pushed
  each step): paramserver serving a copy of the model whose tables are plain dense parameters.

Writes JSON (``--out``) with samples/s of each and the ratios. Usage:

    .venv/bin/python benchmarks/bench_core.py --out bench_core.json
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from report import machine, save
from torch import Tensor, nn

import paramserver as ps
from paramserver.baseline import train_single_process
from paramserver.data.synthetic import SyntheticClickLogs, SyntheticSpec
from paramserver.models.dlrm import DLRM

ROWS, DIM, BATCH = 1_000_000, 32, 1024


def dlrm() -> DLRM:
    return DLRM(table_rows=[ROWS] * 8, embedding_dim=DIM)


class DenseTable(nn.Module):
    """An embedding table as a plain parameter: a parameter server moves it whole."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim).uniform_(-0.05, 0.05))

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight)


def naive_dlrm() -> DLRM:
    model = dlrm()
    model.embeddings = nn.ModuleList(DenseTable(ROWS, DIM) for _ in range(8))
    return model


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda r: r["samples_per_s"])
    return {**ordered[len(ordered) // 2], "all_samples_per_s": [r["samples_per_s"] for r in runs]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    def data_for(batches: int) -> SyntheticClickLogs:
        return SyntheticClickLogs(
            SyntheticSpec(rows_per_table=ROWS, batch_size=BATCH, train_batches=batches)
        )

    config = ps.TrainConfig(
        servers=1, trainers=1, mode="async", optimizer="adagrad", lr=0.05, progress=False
    )
    results: dict[str, Any] = {}

    # Alternate the two, so drifting machine load hits both alike; report medians.
    single_runs, ps_runs = [], []
    for _ in range(args.repeats):
        _, single = train_single_process(
            dlrm, data_for(args.steps).train_batches, F.binary_cross_entropy_with_logits, config
        )
        single_runs.append(single)
        result = ps.train(
            dlrm, data_for(args.steps).train_batches, F.binary_cross_entropy_with_logits, config
        )
        assert result is not None
        summary = result.summary
        ps_runs.append(
            {
                "samples_per_s": summary["samples_per_s"],
                "samples": summary["samples"],
                "seconds": summary["train_seconds"],
                "wall_s": summary["wall_s"],
                "bytes_per_step": summary["bytes_per_step"],
            }
        )
    results["single_process"] = median_run(single_runs)
    results["paramserver"] = median_run(ps_runs)

    if args.naive_steps:
        result = ps.train(
            naive_dlrm,
            data_for(args.naive_steps).train_batches,
            F.binary_cross_entropy_with_logits,
            config,
        )
        assert result is not None
        results["naive_ps"] = {
            "samples_per_s": result.summary["samples_per_s"],
            "samples": result.summary["samples"],
            "seconds": result.summary["train_seconds"],
            "bytes_per_step": result.summary["bytes_per_step"],
        }
    base = results["single_process"]["samples_per_s"]
    ours = results["paramserver"]["samples_per_s"]
    results["ratios"] = {"paramserver_vs_single_process": ours / base}
    if "naive_ps" in results:
        results["ratios"]["paramserver_vs_naive_ps"] = ours / results["naive_ps"]["samples_per_s"]
    results["workload"] = {
        "tables": 8,
        "rows": ROWS,
        "dim": DIM,
        "batch": BATCH,
        "steps": args.steps,
        "naive_steps": args.naive_steps,
        "repeats": args.repeats,
    }
    results["machine"] = machine()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--naive-steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench_core.json")
    args = parser.parse_args()
    results = run(args)
    save(results, args.out)


if __name__ == "__main__":
    main()
