"""What ``--recover`` costs a job that runs without a fault: the default DLRM job (2 servers, 2
trainers, processes launcher, async) from the command line, alternating, with no change log,
with a change log for serving only (``--publish-dir``, one segment a second) and with
``--recover`` (the same log holding recovery sections: rows with their optimizer state, the
books; trainers keeping the calls it does not hold yet). Per run: samples/s and CPU seconds
per 1000 samples (every process of the job, from the launcher's children's rusage); ratios
of medians against no log. Goal: ``--recover`` >= 0.95x.

    .venv/bin/python benchmarks/bench_recover_cost.py --pairs 3 \\
        --out benchmarks/results/bench_recover_cost.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from report import machine, save

REPO = Path(__file__).resolve().parents[1]
JOB_FLAGS = ["--train-batches", "3000", "--no-progress"]
VARIANTS = {
    "no_log": [],
    "publishing": ["--publish-every", "1"],
    "recover": ["--publish-every", "1", "--recover"],
}


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_job(variant: str) -> dict[str, float]:
    """The default job with ``variant``'s flags: its samples/s and CPU per 1000 samples."""
    with tempfile.TemporaryDirectory() as scratch:
        summary = Path(scratch) / "summary.json"
        argv = ["train", *JOB_FLAGS, "--summary-json", str(summary), *VARIANTS[variant]]
        if variant != "no_log":
            argv += ["--publish-dir", str(Path(scratch) / "log")]
        cpu_before = children_cpu_s()
        done = subprocess.run(
            [sys.executable, "-m", "paramserver", *argv], cwd=REPO, capture_output=True,
            text=True, timeout=900,
        )  # fmt: skip
        cpu = children_cpu_s() - cpu_before
        if done.returncode != 0:
            raise SystemExit(f"the {variant} job failed:\n{done.stderr[-3000:]}")
        figures = json.loads(summary.read_text())
        samples = float(figures["samples"])
        return {
            "samples_per_s": float(figures["samples_per_s"]),
            "cpu_s_per_1000_samples": 1000 * cpu / samples,
        }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", default="bench_recover_cost.json")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {variant: [] for variant in VARIANTS}
    for _ in range(args.pairs):  # alternating: the machine's drift falls on every variant
        for variant in VARIANTS:
            runs[variant].append(run_job(variant))
            print(variant, runs[variant][-1], flush=True)
    medians = {
        variant: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for variant, results in runs.items()
    }
    plain = medians["no_log"]["samples_per_s"]
    report: dict[str, Any] = {
        "machine": machine(),
        "job": ["paramserver", "train", *JOB_FLAGS],
        "runs": runs,
        "medians": medians,
        "samples_per_s_vs_no_log": {v: m["samples_per_s"] / plain for v, m in medians.items()},
        "goal": "recover >= 0.95x of no_log",
    }
    save(report, args.out)


if __name__ == "__main__":
    main()
