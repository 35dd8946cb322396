"""Criteo ingestion: lines per second per core into ready batches, next to pyarrow's CSV reader.

On one file of ``--lines`` lines written by ``write_synthetic_criteo`` (200,000 by default),
in one process with one torch thread, each measure taken ``--repeats`` times in alternation:

- ``reader``: ``CriteoFiles([FILE], batch_size).train_batches(0, 1)``, one whole pass into
  batches (parsed, hashed, cut), its reading thread included. Per core: lines / the process's
  CPU seconds over the pass (the consumer only waits); per wall second too.
- ``read_csv``: ``pyarrow.csv.read_csv`` of the same file (tab-separated, column types
  inferred, one thread), the reference: goals ``reader`` >= 0.6 x ``read_csv`` per core, and
  >= 500k lines/s per core. The ratio is taken within each repetition (same machine state)
  and reported as the median and range of those ratios.
- ``line_by_line``: ``CriteoFiles.reference_batches``, the reader before issue 14 (a regular
  expression and ``int()`` per field), on the first ``--old-lines`` lines, once per repeat.

Each reader reads the file once, untimed, before the repetitions (the memory allocators' first
pages would otherwise count against the first repetition).

With ``--train``, also ``paramserver train --dataset criteo:FILE --servers 1 --trainers 1``
(async, one epoch) in a fresh process: its samples/s, and the reader's share of a trainer's
step, samples/s / reader lines/s per core: the fraction of one core that keeps the trainer fed
(the reading thread overlaps it with the step; on a machine with a spare core it costs the step
nothing). The machine is shared and noisy: compare within one run, and repeat.

    .venv/bin/python benchmarks/bench_ingest.py --train --out benchmarks/results/bench_ingest.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.csv as pa_csv
import torch
from report import machine, save

from paramserver.data.criteo import CriteoFiles, write_synthetic_criteo

GOAL_RATIO = 0.6  # issue 14: the reader at >= 0.6 x read_csv, per core
GOAL_LINES_PER_S = 500_000  # and >= 500k lines/s per core


def timed(count: Callable[[], int]) -> dict[str, float]:
    """Lines/s of ``count()`` (which returns the lines it read), per CPU second of this
    process (all its threads) and per wall second."""
    cpu, wall = time.process_time(), time.perf_counter()
    lines = count()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"lines": lines, "per_core": lines / cpu, "per_wall_s": lines / wall, "cpu_s": cpu}


def read_with_reader(path: Path, batch_size: int) -> int:
    return sum(len(label) for _, label in CriteoFiles([path], batch_size).train_batches(0, 1))


def read_with_arrow(path: Path) -> int:
    table = pa_csv.read_csv(
        path,
        read_options=pa_csv.ReadOptions(autogenerate_column_names=True, use_threads=False),
        parse_options=pa_csv.ParseOptions(delimiter="\t"),
    )
    return table.num_rows


def read_line_by_line(path: Path, batch_size: int, lines: int) -> int:
    batches = CriteoFiles([path], batch_size).reference_batches(0, 1)
    taken = itertools.islice(batches, -(-lines // batch_size))
    return sum(len(label) for _, label in taken)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def compare_readers(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"reader": [], "read_csv": [], "line_by_line": []}
    read_with_reader(path, args.batch_size)  # warm-ups, untimed: the allocators' first pages
    read_with_arrow(path)
    for _ in range(args.repeats):
        runs["reader"].append(timed(lambda: read_with_reader(path, args.batch_size)))
        runs["read_csv"].append(timed(lambda: read_with_arrow(path)))
        runs["line_by_line"].append(
            timed(lambda: read_line_by_line(path, args.batch_size, args.old_lines))
        )
    ratios = [
        reader["per_core"] / arrow["per_core"]
        for reader, arrow in zip(runs["reader"], runs["read_csv"], strict=True)
    ]
    summary = {
        name: {
            "lines_per_s_per_core": spread([r["per_core"] for r in measured]),
            "lines_per_wall_s": spread([r["per_wall_s"] for r in measured]),
        }
        for name, measured in runs.items()
    }
    old = summary["line_by_line"]["lines_per_s_per_core"]["median"]
    reader = summary["reader"]["lines_per_s_per_core"]["median"]
    ratio = spread(ratios)
    return {
        "runs": runs,
        "summary": summary,
        "reader_over_read_csv_per_core": ratio,
        "reader_over_line_by_line_per_core": reader / old,
        "goals": {
            "reader_over_read_csv_per_core": GOAL_RATIO,
            "met_by_median_ratio": ratio["median"] >= GOAL_RATIO,
            "lines_per_s_per_core": GOAL_LINES_PER_S,
            "met_by_median_rate": reader >= GOAL_LINES_PER_S,
        },
    }


def train_job(path: Path, work: Path, timeout_s: float) -> dict[str, Any]:
    """``paramserver train --dataset criteo:FILE --servers 1 --trainers 1`` in a fresh process."""
    summary_path = work / "summary.json"
    command = [sys.executable, "-m", "paramserver", "train", "--dataset", f"criteo:{path}"]
    command += ["--servers", "1", "--trainers", "1", "--no-progress"]
    command += ["--summary-json", str(summary_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    summary = json.loads(summary_path.read_text())
    return {
        "command": " ".join(command[1:]),
        "samples_per_s": summary["samples_per_s"],
        "samples": summary["samples"],
        "train_seconds": summary["train_seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--old-lines", type=int, default=50_000)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--train", action="store_true", help="also time a training job")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", default="bench_ingest.json")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per measure (idle intra-op threads spin, and count)
    with tempfile.TemporaryDirectory() as directory:
        work = Path(directory)
        path = work / "day_0"
        write_synthetic_criteo(path, args.lines, seed=0)
        results: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(["benchmarks/bench_ingest.py", *sys.argv[1:]]),
            "machine": machine(),
            "file": {"lines": args.lines, "bytes": path.stat().st_size},
            "batch_size": args.batch_size,
            "readers": compare_readers(path, args),
        }
        if args.train:
            job = train_job(path, work, args.timeout)
            rate = results["readers"]["summary"]["reader"]["lines_per_s_per_core"]["median"]
            job["reader_share_of_a_step"] = job["samples_per_s"] / rate
            results["train"] = job
    save(results, args.out)


if __name__ == "__main__":
    main()
