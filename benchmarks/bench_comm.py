"""Consistency and communication benchmark: every mode, codec, the cache and prefetch, on the
default job (``paramserver train``'s: DLRM, 8 tables x 100k rows x 16, Zipf ids with exponent
1.1, 3000 batches of 512, 2 servers + 2 trainer processes), side by side in one run.

For each variant: samples/s and its ratio to single-process training of the same model on the
same data; bytes per step each way, their ratio to the minimal bytes of a step (below) and to
plain async's (fp32, no codec: ``bytes_vs_fp32``, push, pull and both together); embedding-row
bytes pulled per step; held-out AUC and its difference from plain async; the staleness
histogram's mean; the cache's hit rate. Writes JSON (``--out``, the issue-14 goals under
``goals``) and prints a markdown table.

The minimal bytes of a step, computed from the data (``minimal_bytes_per_step``):

* pull: the step's distinct rows x dim x 4 + the dense parameters x 4. An answer names no ids
  (its rows come in the order the request asked for them).
* push: the same rows' gradients and the dense gradients, plus the ids' own minimal encoding.
  A push names, per table and server, two sets of distinct rows: those of its gradients and
  those its next step pulls (the same step's set, sent twice over two calls). A set of ``k``
  distinct rows out of the ``N`` a server holds of a table takes at least ``log2 C(N, k)``
  bits: that many sets exist, and no encoding names every one of them in fewer bits (nor, on
  average, sets drawn uniformly). It is ``paramserver.wire.idcodec.min_id_nbytes``; summed over both
  sets of every table and server and averaged over steps, it is ``ids_push`` in the JSON.

``id_bytes_per_id`` gives, over the same sets, what an id costs as int64, as packed on the wire
(``paramserver.wire.idcodec.compact_ids``, first ids included) and at the bound.

    .venv/bin/python benchmarks/bench_comm.py --out benchmarks/results/bench_comm.json
"""

from __future__ import annotations

import argparse
import json
import sys
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
from paramserver.wire.idcodec import compact_ids, min_id_nbytes
from paramserver.wire.sizing import payload_nbytes


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


def minimal_bytes_per_step(
    data: SyntheticClickLogs, model: DLRM, trainers: int, servers: int
) -> dict[str, Any]:
    """The least a step moves each way (see the module docstring), and what its ids cost."""
    tables = [
        m for m in model.modules() if isinstance(m, torch.nn.EmbeddingBag | torch.nn.Embedding)
    ]
    row_bytes = tables[0].embedding_dim * 4
    table_params = {id(m.weight) for m in tables}
    dense = sum(p.numel() * 4 for p in model.parameters() if id(p) not in table_params)
    rows = data.spec.rows_per_table
    held = [len(range(server, rows, servers)) for server in range(servers)]
    row_total = ids = packed = bound = 0.0
    steps = 0
    for trainer in range(trainers):
        for (_, sparse), _ in data.train_batches(trainer, trainers):
            steps += 1
            for table in range(sparse.shape[1]):
                unique = sparse[:, table].unique()
                row_total += unique.numel() * row_bytes
                ids += unique.numel()
                for server in range(servers):  # fixed tables: row r on server r % servers
                    mine = unique[unique % servers == server]
                    packed += payload_nbytes(compact_ids(mine))
                    bound += min_id_nbytes(mine.numel(), held[server])
    # Each set is sent twice: as a pull's ids, then with its rows' gradients.
    return {
        "push": (row_total + 2 * bound) / steps + dense,
        "pull": row_total / steps + dense,
        "ids_push": 2 * bound / steps,
        "dense": dense,
        "id_bytes_per_id": {"int64": 8.0, "packed": packed / ids, "bound": bound / ids},
    }


def goals(results: dict[str, Any]) -> dict[str, Any]:
    """Issue 14's goals: plain fp32 push and pull within 1.05x of the minimal bytes; int8 on
    every path at most 0.3x of fp32's bytes (push and pull together), AUC within 0.005."""
    fp32, int8 = results.get("async"), results.get("int8")
    out: dict[str, Any] = {}
    if fp32 is not None:
        out["fp32_push_vs_minimal"] = fp32["push_vs_minimal"]
        out["fp32_pull_vs_minimal"] = fp32["pull_vs_minimal"]
        out["fp32_met"] = max(fp32["push_vs_minimal"], fp32["pull_vs_minimal"]) <= 1.05
    if fp32 is not None and int8 is not None:
        out["int8_vs_fp32"] = int8["bytes_vs_fp32"]
        out["int8_auc_minus_fp32"] = int8["auc_minus_async"]
        out["int8_met"] = (
            int8["bytes_vs_fp32"]["total"] <= 0.3 and abs(int8["auc_minus_async"]) <= 0.005
        )
    return out


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
    minimal = minimal_bytes_per_step(data, model_fn(), base.trainers, base.servers)
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
    add_ratios(results, minimal)
    reference = results.get("async")
    if reference is not None and "cache" in results:
        results["cache"]["row_bytes_vs_async"] = (
            results["cache"]["row_bytes_per_step"] / reference["row_bytes_per_step"]
        )
    report = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["benchmarks/bench_comm.py", *sys.argv[1:]]),
        "minimal_bytes_per_step": minimal,
        "goals": goals(results),
        "seconds": time.perf_counter() - started,
        "results": results,
    }
    save(report, args.out, echo=False)
    print(json.dumps(report["goals"]))
    print_table(results)


def add_ratios(results: dict[str, Any], minimal: dict[str, Any]) -> None:
    """Each variant's speed against single-process training, bytes against the minimal
    bytes and against plain async (fp32), and AUC against plain async."""
    reference = results.get("async")
    for name, r in results.items():
        r["speed_vs_single"] = r["samples_per_s"] / results["single_process"]["samples_per_s"]
        if name != "single_process":
            push, pull = r["bytes_per_step"]["push"], r["bytes_per_step"]["pull"]
            r["push_vs_minimal"] = push / minimal["push"]
            r["pull_vs_minimal"] = pull / minimal["pull"]
            if reference is not None:
                fp32 = reference["bytes_per_step"]
                r["bytes_vs_fp32"] = {
                    "push": push / fp32["push"],
                    "pull": pull / fp32["pull"],
                    "total": (push + pull) / (fp32["push"] + fp32["pull"]),
                }
        if reference is not None:
            r["auc_minus_async"] = r["eval_auc"] - reference["eval_auc"]


def print_table(results: dict[str, Any]) -> None:
    print(
        "| variant | samples/s | x single | push B/step | pull B/step | push/minimal "
        "| pull/minimal | bytes x fp32 | AUC | dAUC |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        b = r.get("bytes_per_step", {"push": 0, "pull": 0})
        print(
            f"| {name} | {r['samples_per_s']:,.0f} | {r['speed_vs_single']:.2f} | "
            f"{b['push']:,.0f} | {b['pull']:,.0f} | {r.get('push_vs_minimal', 0):.3f} | "
            f"{r.get('pull_vs_minimal', 0):.3f} | "
            f"{r.get('bytes_vs_fp32', {}).get('total', 0):.3f} | "
            f"{r['eval_auc']:.4f} | {r.get('auc_minus_async', 0):+.4f} |"
        )


if __name__ == "__main__":
    main()
