"""The bench suite's smoke run (``benchmarks/bench_suite.py --quick``) reports every entry.

Runs the script as a subprocess, as a user would, and checks its JSON and markdown table: one
entry per (workload, system), each with a positive rate, finite metrics, memory figures and
the bytes its kind of system moves. The expected entries are listed here, not read from the
script, so an entry that goes missing fails the test.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.system  # starts processes or whole jobs: the system tier

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_suite.py"
PS_SYSTEMS = ("naive_ps", "ps_async", "ps_sync", "ps_ssp")
EXPECTED = {
    ("dlrm", "single_process"),
    ("dlrm", "naive_ps"),
    ("dlrm", "ddp_sparse"),
    ("dlrm", "ddp_dense"),
    ("dlrm", "ps_async"),
    ("dlrm", "ps_sync"),
    ("dlrm", "ps_ssp"),
    ("dlrm", "ps_allreduce"),
    ("mlp", "single_process"),
    ("mlp", "naive_ps"),
    ("mlp", "ddp"),
    ("mlp", "ps_async"),
    ("mlp", "ps_sync"),
    ("mlp", "ps_ssp"),
    ("mlp", "ps_allreduce"),
}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench_suite")
    command = [
        sys.executable,
        str(SCRIPT),
        "--quick",
        "--out",
        str(out / "suite.json"),
        "--markdown",
        str(out / "suite.md"),
    ]
    # On timeout, run() kills the script; its entries' processes die with it.
    done = subprocess.run(command, cwd=out, capture_output=True, text=True, timeout=140)
    assert done.returncode == 0, done.stderr[-5000:]
    return json.loads((out / "suite.json").read_text()), (out / "suite.md").read_text()


@pytest.mark.timeout(150)
def test_every_entry_is_reported_with_sane_figures(quick_run: tuple[dict, str]) -> None:
    results, _ = quick_run
    entries = {(e["workload"], e["system"]): e for e in results["entries"]}
    assert len(entries) == len(results["entries"]), "an entry is reported twice"
    assert set(entries) == EXPECTED
    for key, entry in entries.items():
        assert entry["samples_per_s"] > 0, key
        assert math.isfinite(entry["speed_vs_single"]) and entry["speed_vs_single"] > 0, key
        assert all(math.isfinite(v) for v in entry["metrics"].values()), key
        assert 0.0 <= entry["metrics"]["auc"] <= 1.0, key
        peaks = entry["peak_rss_mb_per_trainer"]
        assert peaks and all(math.isfinite(p) and p > 0 for p in peaks), key
        moved = entry["bytes_per_step"]
        if key[1] == "ps_allreduce":  # dense gradients all-reduced; tables' rows (dlrm) pushed
            assert moved["allreduce"] > 0 and (moved["push"] > 0) == (key[0] == "dlrm"), key
        elif key[1] in PS_SYSTEMS:
            assert moved["push"] > 0 and moved["pull"] > 0, key
        elif key[1].startswith("ddp"):
            assert moved["allreduce"] > 0, key
        else:
            assert moved == {}, key
    assert entries[("dlrm", "single_process")]["speed_vs_single"] == 1.0
    # The naive server moves whole tables; paramserver only the rows a step touches.
    naive, sharded = entries[("dlrm", "naive_ps")], entries[("dlrm", "ps_async")]
    assert naive["bytes_per_step"]["pull"] > 10 * sharded["bytes_per_step"]["pull"]
    # All-reduced, the MLP's dense gradients are exactly what DDP hands to its all-reduce.
    ddp, reduced = entries[("mlp", "ddp")], entries[("mlp", "ps_allreduce")]
    assert reduced["bytes_per_step"]["allreduce"] == ddp["bytes_per_step"]["allreduce"]
    dense, sparse = entries[("dlrm", "ddp_dense")], entries[("dlrm", "ddp_sparse")]
    assert dense["bytes_per_step"]["allreduce"] > 10 * sparse["bytes_per_step"]["allreduce"]


@pytest.mark.timeout(150)
def test_markdown_has_one_row_per_entry_and_the_machine(quick_run: tuple[dict, str]) -> None:
    results, table = quick_run
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ")]
    header, body = rows[0], rows[1:]
    assert [c.strip() for c in header[:4]] == ["workload", "system", "steps/trainer", "samples/s"]
    keys = [(cells[0].strip(), cells[1].strip()) for cells in body]
    assert sorted(keys) == sorted(EXPECTED)
    machine = results["machine"]
    # Each count named for what it holds: not torch's thread count passed off as the CPUs.
    assert machine["logical_cpus"] == os.cpu_count() and machine["usable_cpus"] >= 1
    assert machine["torch_threads"] >= 1
    assert machine["torch"] and machine["platform"] and results["date"]
    assert f"{machine['logical_cpus']} logical CPUs" in table
    assert f"torch {machine['torch']}" in table and results["date"] in table
