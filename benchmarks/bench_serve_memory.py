"""A served model's memory, its tables in memory against mapped from files (``--mmap-dir``),
side by side in one run, each in a fresh process:

- ``loaded``: after the model is built and a version applied: ``RssAnon`` (memory only this
  process can hold: never given back short of swap) and ``RssFile`` (file pages, which the
  system writes back and drops under pressure);
- ``paged_out``: the mapped model after its table's pages are reclaimed (``MADV_PAGEOUT``: what
  memory pressure does), then ``lookups`` lookups of ``--ids`` ids drawn from a hot set of
  ``--hot`` rows: the memory it holds again (the rows it read), and lookup latency p50/p99
  against the model in memory.

    .venv/bin/python benchmarks/bench_serve_memory.py \
        --out benchmarks/results/bench_serve_memory.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from report import machine, save
from torch import Tensor, nn

from paramserver.changelog.segment import Segment, TableChanges
from paramserver.serving.model import ServedModel

MADV_PAGEOUT = 21  # linux/mman.h (5.4+)


class Wide(nn.Module):
    """One large table and a small head: what dominates a recommendation model's memory."""

    rows = 4_000_000

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(Wide.rows, 64)
        self.head = nn.Linear(64, 1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.table(ids))


def status_kib() -> dict[str, int]:
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmRSS"):
            found[key] = int(value.split()[0])
    return found


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def one(mapped: bool, lookups: int, ids: int, hot: int) -> dict[str, Any]:
    """This process's figures for one way of holding the table (see the module doc)."""
    with tempfile.TemporaryDirectory() as scratch:
        served = ServedModel(Wide, 0, mmap_dir=scratch if mapped else None)
        version = Segment("job", 0, 1, 0, 1, 1, 0, 1)
        changed = torch.randperm(Wide.rows)[:100_000].sort().values
        version.tables["table.weight"] = TableChanges(
            changed, torch.randn(changed.numel(), 64), torch.zeros(0, dtype=torch.int64)
        )
        served.apply([version])
        figures: dict[str, Any] = {"loaded_kib": status_kib()}
        if mapped:
            weight = served.store.tables["table.weight"].weight
            nbytes = weight.numel() * weight.element_size()
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.madvise(ctypes.c_void_p(weight.data_ptr()), ctypes.c_size_t(nbytes),
                            MADV_PAGEOUT) != 0:  # fmt: skip
                raise OSError(ctypes.get_errno(), "madvise(MADV_PAGEOUT)")
            figures["paged_out_kib"] = status_kib()
        hot_rows = torch.randperm(Wide.rows)[:hot]
        seconds = []
        for _ in range(lookups):
            wanted = hot_rows[torch.randint(hot, (ids,))]
            started = time.perf_counter()
            served.lookup("table.weight", wanted)
            seconds.append(time.perf_counter() - started)
        figures["after_lookups_kib"] = status_kib()
        figures["lookup_ms"] = {
            "p50": 1e3 * percentile(seconds, 50),
            "p99": 1e3 * percentile(seconds, 99),
        }
        return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lookups", type=int, default=20_000)
    parser.add_argument("--ids", type=int, default=26)
    parser.add_argument("--hot", type=int, default=20_000, help="rows the lookups draw from")
    parser.add_argument("--one", choices=["memory", "mapped"], help=argparse.SUPPRESS)
    parser.add_argument("--out", default="bench_serve_memory.json")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one == "mapped", args.lookups, args.ids, args.hot)))
        return
    runs = {}
    for way in ("memory", "mapped"):
        done = subprocess.run(
            [sys.executable, __file__, "--one", way, "--lookups", str(args.lookups),
             "--ids", str(args.ids), "--hot", str(args.hot)],
            capture_output=True, text=True, check=True, timeout=1800,
        )  # fmt: skip
        runs[way] = json.loads(done.stdout.splitlines()[-1])
    table_mib = Wide.rows * 64 * 4 / 2**20
    memory, mapped = runs["memory"], runs["mapped"]
    save(
        {
            "machine": machine(),
            "table": {"rows": Wide.rows, "dim": 64, "mib": table_mib},
            "lookups": args.lookups,
            "ids_per_lookup": args.ids,
            "hot_rows": args.hot,
            "memory": memory,
            "mapped": mapped,
            "ratios": {
                "mapped_vs_memory_rss_anon_loaded": mapped["loaded_kib"]["RssAnon"]
                / memory["loaded_kib"]["RssAnon"],
                "mapped_vs_memory_lookup_p50": mapped["lookup_ms"]["p50"]
                / memory["lookup_ms"]["p50"],
                "mapped_vs_memory_lookup_p99": mapped["lookup_ms"]["p99"]
                / memory["lookup_ms"]["p99"],
            },
        },
        args.out,
    )


if __name__ == "__main__":
    main()
