"""Consistency and communication benchmark: every mode, codec, the cache and prefetch, on the
default job (``paramserver train``'s: DLRM, 8 tables x 100k rows x 16, Zipf ids with exponent
1.1, 3000 batches of 512, 2 servers + 2 trainer processes), side by side in one run.

For each variant: samples/s and its ratio to single-process training of the same model on the
same data; bytes per step each way and their ratio to the bytes a step needs (its unique rows x
row bytes + the dense parameters, computed from the data); embedding-row bytes pulled per step;
held-out AUC and its difference from plain async; the staleness histogram's mean; the cache's
hit rate. Writes JSON (``--out``) and prints a markdown table.

    .venv/bin/python benchmarks/bench_comm.py --out benchmarks/results/bench_comm.json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import torch.nn.functional as F
from report import machine, save

import paramserver as ps
from paramserver.baseline import train_single_process
from paramserver.data.synthetic import SyntheticClickLogs, SyntheticSpec
from paramserver.metrics import evaluate_binary
from paramserver.models.dlrm import DLRM


def codec(name: str) -> dict[str, Any]:
    """The codec on every path it suits: top-k on dense gradients, the others everywhere."""
    if name == "topk":
        return {"dense_push_codec": "topk"}
    paths = ("dense_push_codec", "dense_pull_codec", "table_push_codec", "table_pull_codec")
    return dict.fromkeys(paths, name)


VARIANTS: dict[str, dict[str, Any]] = {
    "async": {},
    "async_no_prefetch": {"prefetch": False},
    "sync": {"mode": "sync"},
    "ssp_s2": {"mode": "ssp", "ssp_bound": 2},
    "fp16": codec("fp16"),
    "bf16": codec("bf16"),
    "int8": codec("int8"),
    "topk_1pct": codec("topk"),
    "cache": {"cache_rows": 50_000, "cache_lag": 32},
}


def needed_bytes_per_step(data: SyntheticClickLogs, model: DLRM, trainers: int) -> float:
    """What a step must move at least: its unique rows x row bytes, plus the dense parameters."""
    tables = [
        m for m in model.modules() if isinstance(m, torch.nn.EmbeddingBag | torch.nn.Embedding)
    ]
    row_bytes = tables[0].embedding_dim * 4
    table_params = {id(m.weight) for m in tables}
    dense = sum(p.numel() * 4 for p in model.parameters() if id(p) not in table_params)
    total = steps = 0
    for trainer in range(trainers):
        for (_, sparse), _ in data.train_batches(trainer, trainers):
            total += sum(sparse[:, t].unique().numel() for t in range(sparse.shape[1])) * row_bytes
            total += dense
            steps += 1
    return total / steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--train-batches", type=int, default=3000)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default="bench_comm.json")
    args = parser.parse_args()
    spec = SyntheticSpec(train_batches=args.train_batches)
    data = SyntheticClickLogs(spec)
    held_out = [batch for batch, _ in data.eval_batches()]

    def model_fn() -> DLRM:
        return DLRM(table_rows=[spec.rows_per_table] * spec.num_tables)

    base = ps.TrainConfig(progress=False)
    needed = needed_bytes_per_step(data, model_fn(), base.trainers)
    loss = F.binary_cross_entropy_with_logits
    started = time.perf_counter()
    model, single = train_single_process(model_fn, data.train_batches, loss, base)
    results: dict[str, Any] = {
        "single_process": {
            "samples_per_s": single["samples_per_s"],
            "eval_auc": evaluate_binary(model, held_out)["auc"],
        }
    }
    for name in args.variants.split(","):
        result = ps.train(model_fn, data.train_batches, loss, base.replace(**VARIANTS[name]))
        s = result.summary
        ages = s["staleness"]
        results[name] = {
            "options": VARIANTS[name],
            "samples_per_s": s["samples_per_s"],
            "bytes_per_step": s["bytes_per_step"],
            "row_bytes_per_step": s["row_bytes_per_step"],
            "compression_ratio": s["compression_ratio"],
            "eval_auc": evaluate_binary(result.model, held_out)["auc"],
            "mean_staleness": sum(int(a) * c for a, c in ages.items()) / max(sum(ages.values()), 1),
            "cache_hit_rate": s["cache"]["hit_rate"],
        }
        print(name, json.dumps(results[name]), flush=True)
    reference = results.get("async")
    for name, r in results.items():
        r["speed_vs_single"] = r["samples_per_s"] / results["single_process"]["samples_per_s"]
        if name != "single_process":
            r["push_vs_needed"] = r["bytes_per_step"]["push"] / needed
            r["pull_vs_needed"] = r["bytes_per_step"]["pull"] / needed
        if reference is not None:
            r["auc_minus_async"] = r["eval_auc"] - reference["eval_auc"]
    if reference is not None and "cache" in results:
        results["cache"]["row_bytes_vs_async"] = (
            results["cache"]["row_bytes_per_step"] / reference["row_bytes_per_step"]
        )
    report = {
        "machine": machine(),
        "needed_bytes_per_step": needed,
        "seconds": time.perf_counter() - started,
        "results": results,
    }
    save(report, args.out, echo=False)
    print(
        "| variant | samples/s | x single | push B/step | pull B/step | pull/needed | AUC | dAUC |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        b = r.get("bytes_per_step", {"push": 0, "pull": 0})
        print(
            f"| {name} | {r['samples_per_s']:,.0f} | {r['speed_vs_single']:.2f} | "
            f"{b['push']:,.0f} | {b['pull']:,.0f} | {r.get('pull_vs_needed', 0):.2f} | "
            f"{r['eval_auc']:.4f} | {r.get('auc_minus_async', 0):+.4f} |"
        )


if __name__ == "__main__":
    main()
