"""Memory per server as servers are added, and a model no single process could hold.

Memory: the default DLRM (8 fixed tables x dim 16, Adagrad) with 1M-row tables on 1, 2 and 4
servers + 1 trainer, each next to the same job with 1,000-row tables. A server's goal (issue
13): its peak resident memory <= the tiny-table job's peak + 1.25 x (its rows + their optimizer
state). Reported per server count: each server's peak, the bound, their ratio.

Scale (``--huge``): 8 fixed tables x 25M rows x 16 (12.8 GB of values) with row-wise Adagrad
on 4 servers + 1 trainer, 300 batches, without gathering the model. Reported: every process's
peak resident memory (launcher, servers, trainer), the start-up time (from the command's start
to the first step: its wall time less the training time and the time after it) and samples/s.

    .venv/bin/python benchmarks/bench_scale.py --out benchmarks/results/bench_scale.json
    .venv/bin/python benchmarks/bench_scale.py --huge --out benchmarks/results/bench_scale_25m.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from report import machine, save

MIB = 2**20
# Runs the command line in this process and prints this process's own peak memory at exit:
# the launcher's peak, which the job summary does not hold.
LAUNCHER = (
    "import resource, sys\n"
    "from paramserver.cli import main\n"
    "code = 1\n"
    "try:\n"
    "    code = main(sys.argv[1:])\n"
    "finally:\n"
    "    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
    "    print(f'launcher_peak_kib={peak}', file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def run_job(args: list[str], timeout_s: float) -> dict[str, Any]:
    """One ``paramserver train`` job; its summary, wall time and launcher's peak memory."""
    with tempfile.TemporaryDirectory() as work:
        summary_path = Path(work) / "summary.json"
        command = [sys.executable, "-c", LAUNCHER, "train", *args, "--no-progress"]
        command += ["--summary-json", str(summary_path)]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        wall_s = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
        summary = json.loads(summary_path.read_text())
    peak_line = [ln for ln in done.stderr.splitlines() if ln.startswith("launcher_peak_kib=")]
    launcher_mib = int(peak_line[-1].split("=")[1]) / 1024
    return {"summary": summary, "wall_s": wall_s, "launcher_peak_mib": launcher_mib}


def server_peaks_mib(summary: dict[str, Any]) -> list[float]:
    return [s["max_rss_bytes"] / MIB for s in summary["server_stats"]]


def memory_per_server(rows: int, batches: int, timeout_s: float) -> list[dict[str, Any]]:
    """For 1, 2 and 4 servers: each server's peak next to the bound from the tiny-table job."""
    results = []
    for servers in (1, 2, 4):
        common = ["--servers", str(servers), "--trainers", "1", "--train-batches", str(batches)]
        tiny = run_job([*common, "--rows-per-table", "1000", "--no-gather-model"], timeout_s)
        large = run_job([*common, "--rows-per-table", str(rows), "--no-gather-model"], timeout_s)
        held = large["summary"]["tables"]
        held_mib = sum(t["memory_bytes"] for t in held.values()) / MIB / servers
        tiny_peak = max(server_peaks_mib(tiny["summary"]))
        bound = tiny_peak + 1.25 * held_mib
        peaks = server_peaks_mib(large["summary"])
        results.append({
            "servers": servers,
            "rows_and_state_mib_per_server": round(held_mib, 1),
            "tiny_table_peak_mib": round(tiny_peak, 1),
            "bound_mib": round(bound, 1),
            "server_peaks_mib": [round(p, 1) for p in peaks],
            "worst_peak_over_bound": round(max(peaks) / bound, 3),
            "meets_goal": max(peaks) <= bound,
        })  # fmt: skip
        print(json.dumps(results[-1]), flush=True)
    return results


def huge_job(rows: int, batches: int, timeout_s: float) -> dict[str, Any]:
    args = [
        "--servers", "4", "--trainers", "1", "--rows-per-table", str(rows),
        "--table-optimizer", "rowwise_adagrad", "--train-batches", str(batches),
        "--no-gather-model",
    ]  # fmt: skip
    job = run_job(args, timeout_s)
    summary = job["summary"]
    values_gb = 8 * rows * 16 * 4 / 1e9
    return {
        "command": "paramserver train " + " ".join(args),
        "values_gb": values_gb,
        "steps": summary["steps"],
        "samples_per_s": summary["samples_per_s"],
        "train_seconds": summary["train_seconds"],
        "wall_s": job["wall_s"],
        "startup_s": job["wall_s"] - summary["train_seconds"],
        "launcher_peak_mib": round(job["launcher_peak_mib"], 1),
        "server_peaks_mib": [round(p, 1) for p in server_peaks_mib(summary)],
        "trainer_peaks_mib": [round(p, 1) for p in summary["peak_rss_mb_per_trainer"]],
        "tables_memory_gb": sum(t["memory_bytes"] for t in summary["tables"].values()) / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows per table (memory)")
    parser.add_argument("--batches", type=int, default=100, help="batches per memory job")
    parser.add_argument("--huge", action="store_true", help="the 8 x 25M x 16 job instead")
    parser.add_argument("--huge-rows", type=int, default=25_000_000)
    parser.add_argument("--huge-batches", type=int, default=300)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per job")
    parser.add_argument("--out", default="bench_scale.json")
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    results: dict[str, Any] = {"machine": machine(), "started": started}
    if args.huge:
        results["huge"] = huge_job(args.huge_rows, args.huge_batches, args.timeout)
    else:
        results["rows_per_table"] = args.rows
        results["memory_per_server"] = memory_per_server(args.rows, args.batches, args.timeout)
    save(results, args.out)


if __name__ == "__main__":
    main()
