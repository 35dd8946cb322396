"""Criteo-format click logs end to end: paramserver next to its single-process reference and to
what a user would try first, plain PyTorch.

On one file of ``--lines`` lines written by ``write_synthetic_criteo`` (200,000 by default),
batches of 512, one epoch, each entry ``--repeats`` times in alternation:

- ``paramserver``: ``paramserver train --dataset criteo:FILE --servers 1 --trainers 1
  --compare-single-process`` (async; a DLRM with one ``DynamicEmbedding`` per categorical
  column), in a fresh process: the job's samples/s, and its reference's (the same model and
  reader in one process, its dynamic tables trained with the servers' own table code), both
  from the job's summary.
- ``plain_pytorch``: the file parsed up front into batches (by the same reader), then the same
  DLRM with 26 fixed ``nn.Embedding(200_000, 16, sparse=True)`` tables (ids modulo 200,000)
  and Adagrad (sparse for the tables), one torch thread, in this process: samples/s over the
  pass (training only: parsing is not timed).

Reported: medians, and the ratios paramserver / reference and paramserver / plain PyTorch
(goals of issue 14: both >= 1.0), the latter also per repetition (its two runs back to back)
with their median. The machine is shared and noisy: compare within one run.

    .venv/bin/python benchmarks/bench_criteo.py --out benchmarks/results/bench_criteo.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from report import machine, save

from paramserver.data.criteo import NUM_CATEGORICAL, NUM_DENSE, CriteoFiles, write_synthetic_criteo
from paramserver.models import DLRM

BATCH = 512
PLAIN_ROWS = 200_000


def paramserver_job(
    path: Path, tree: Path | None = None, flags: Sequence[str] = ()
) -> dict[str, float]:
    """The job's and its reference's samples/s; ``tree``: run another checkout's paramserver
    (its compiled loops built in place) instead of this one; ``flags``: more of this tree's
    job's command-line flags."""
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as work:
        summary_path = Path(work) / "summary.json"
        subprocess.run(
            [sys.executable, "-m", "paramserver", "train", "--dataset", f"criteo:{path}",
             "--servers", "1", "--trainers", "1", "--batch-size", str(BATCH),
             "--compare-single-process", "--no-progress", "--summary-json", str(summary_path),
             *flags],
            check=True, capture_output=True, timeout=3600, cwd=tree, env=env,
        )  # fmt: skip
        summary = json.loads(summary_path.read_text())
    return {
        "paramserver": summary["samples_per_s"],
        "reference": summary["single_process"]["samples_per_s"],
    }


def plain_pytorch(batches: list[Any]) -> float:
    """Samples/s of plain PyTorch on the parsed batches (see the module docstring)."""
    torch.manual_seed(0)
    model = DLRM(num_dense=NUM_DENSE, table_rows=[PLAIN_ROWS] * NUM_CATEGORICAL)
    for table in model.embeddings:
        assert isinstance(table, torch.nn.Embedding)
        table.sparse = True
    tables = [p for t in model.embeddings for p in t.parameters()]
    dense = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    optimizers = [torch.optim.Adagrad(dense, lr=0.01), torch.optim.Adagrad(tables, lr=0.01)]
    samples = 0
    started = time.perf_counter()
    for (dense_x, sparse_x), label in batches:
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        logits = model(dense_x, torch.remainder(sparse_x, PLAIN_ROWS))
        F.binary_cross_entropy_with_logits(logits, label).backward()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Sparse invariant checks")
            for optimizer in optimizers:
                optimizer.step()
        samples += int(label.shape[0])
    return samples / (time.perf_counter() - started)


def compared(runs: dict[str, list[float]], tree: Path | None) -> dict[str, Any]:
    """The other checkout's job against plain PyTorch and against this one, per repetition."""
    if tree is None:
        return {}
    plain, it = runs["plain_pytorch"], runs["compared_tree"]
    against_plain = [c / p for c, p in zip(it, plain, strict=True)]
    this_vs_it = [t / c for t, c in zip(runs["paramserver"], it, strict=True)]
    return {
        "compared_tree": str(tree),
        "compared_tree_vs_plain_pytorch_per_repetition": against_plain,
        "compared_tree_vs_plain_pytorch_median_of_repetitions": statistics.median(against_plain),
        "paramserver_vs_compared_tree_per_repetition": this_vs_it,
        "paramserver_vs_compared_tree_median_of_repetitions": statistics.median(this_vs_it),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench_criteo.json")
    parser.add_argument(
        "--compare-tree",
        type=Path,
        help="another checkout (say, the last release: `git worktree add DIR REV`, then "
        "`python setup.py build_ext --inplace` in it) whose job runs in each repetition too",
    )
    parser.add_argument(
        "--job-flags",
        default="",
        help="more flags for this tree's job (say, --no-prefetch-own-updates); not the other's",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs: dict[str, list[float]] = {"paramserver": [], "reference": [], "plain_pytorch": []}
    if args.compare_tree is not None:
        runs["compared_tree"] = []
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "day_0"
        write_synthetic_criteo(path, args.lines, seed=0)
        batches = list(CriteoFiles([path], batch_size=BATCH).train_batches(0, 1))
        for _ in range(args.repeats):
            job = paramserver_job(path, flags=args.job_flags.split())
            runs["paramserver"].append(job["paramserver"])
            runs["reference"].append(job["reference"])
            runs["plain_pytorch"].append(plain_pytorch(batches))
            if args.compare_tree is not None:
                other = paramserver_job(path, args.compare_tree)
                runs["compared_tree"].append(other["paramserver"])
            print(json.dumps({k: round(v[-1]) for k, v in runs.items()}), flush=True)
    median = {k: statistics.median(v) for k, v in runs.items()}
    # Each repetition's runs follow one another, so their ratio shares the host's load of the
    # moment; the median of those ratios is the figure least moved by other tenants.
    paired = [p / q for p, q in zip(runs["paramserver"], runs["plain_pytorch"], strict=True)]
    save(
        {
            "machine": machine(),
            "lines": args.lines,
            "job_flags": args.job_flags,
            "runs_samples_per_s": runs,
            "median_samples_per_s": median,
            "paramserver_vs_reference": median["paramserver"] / median["reference"],
            "paramserver_vs_plain_pytorch": median["paramserver"] / median["plain_pytorch"],
            "paramserver_vs_plain_pytorch_per_repetition": paired,
            "paramserver_vs_plain_pytorch_median_of_repetitions": statistics.median(paired),
            **compared(runs, args.compare_tree),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
