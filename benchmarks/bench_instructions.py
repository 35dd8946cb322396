"""Instructions a server executes per call on the core benchmark model, counted by valgrind.

``bench_tables.py --only server_cpu`` times the same calls in CPU seconds, which the host's
other tenants move by up to 2x from run to run (memory and cache contention show in CPU time
too). An instruction count does not move with them: this counts, under valgrind's cachegrind,
the instructions of a server process making ``--calls`` more warm calls than a shorter run of
the same script, for fixed and for dynamic tables (8 x 1M x 32, Adagrad, batch 1024: a call
pushes the gradients of the rows the call before pulled and pulls ~4,300 rows), here and in
``--compare-tree`` (another checkout with its compiled loops built in place), side by side.
Memory stalls are not instructions: this measures the work around the rows (checks, walks,
bookkeeping, the loops' own instructions), not waits on DRAM.

Needs valgrind (``apt install valgrind``); each count takes a minute or two.

    .venv/bin/python benchmarks/bench_instructions.py --compare-tree /tmp/prev \\
        --out benchmarks/results/bench_instructions.json
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from report import machine, save

FILL_CALLS = 10  # the calls both runs make first: every row made, every path warm


def server_calls(kind: str, calls: int) -> None:
    """In this process: a server of the core model with ``kind`` tables, FILL_CALLS calls that
    make its rows, then ``calls`` more over the same steps, as a trainer would make them."""
    import torch
    from bench_tables import DLRM, SyntheticClickLogs, SyntheticSpec, build_server, ps

    from paramserver.wire.messages import PushPullRequest, RowBlock

    torch.set_num_threads(1)
    config = ps.TrainConfig(servers=1, trainers=1, optimizer="adagrad", lr=0.05, progress=False)
    spec = SyntheticSpec(rows_per_table=1_000_000, batch_size=1024, train_batches=FILL_CALLS)
    steps = [inputs[1] for inputs, _ in SyntheticClickLogs(spec).train_batches(0, 1)]
    step_ids = [[sparse[:, t].unique() for t in range(8)] for sparse in steps]
    model = DLRM(table_rows=[1_000_000] * 8, embedding_dim=32, dynamic_tables=kind == "dynamic")
    endpoint = build_server(0, config, lambda: model)
    endpoint.coordinator.close()  # its watchdog thread's instructions would count too
    names = sorted(endpoint.shard.store.tables)
    dense = {n: torch.full_like(s.value, 1e-3) for n, s in endpoint.shard.store.dense.items()}
    grads = [[torch.full((i.numel(), 32), 0.01) for i in ids] for ids in step_ids]
    previous: dict[str, RowBlock] = {}
    for call in range(FILL_CALLS + calls):
        ids = step_ids[call % FILL_CALLS]
        pulled = dict(zip(names, ids, strict=True))
        request = PushPullRequest(0, call, pull_rows=pulled, grads_call=call - 1)
        if previous:
            request.row_grads, request.dense_grads = previous, dict(dense)
        endpoint.coordinator.push_pull(request).wait()
        together = zip(names, ids, grads[call % FILL_CALLS], strict=True)
        previous = {name: RowBlock(table_ids, grad) for name, table_ids, grad in together}


def instructions(tree: Path, kind: str, calls: int) -> int:
    """Instructions of the worker of ``tree``'s own copy of this script (its paramserver
    imported, so a tree whose modules moved is counted by the worker written for it) with
    ``calls`` warm calls, whole process, address layout fixed where setarch can."""
    script = tree / "benchmarks" / Path(__file__).name
    command = [sys.executable, str(script), "--worker", kind, str(calls)]
    valgrind = [
        "valgrind",
        "--tool=cachegrind",
        "--cache-sim=no",
        "--cachegrind-out-file=/dev/null",
    ]
    fixed_layout = ["setarch", os.uname().machine, "-R"] if shutil.which("setarch") else []
    # One thread per pool: an idle BLAS or OpenMP worker spins, and its spinning counts as
    # instructions that depend on scheduling (cg_annotate showed OpenBLAS's blas_thread_server
    # among the differences between two trees' counts), not on the calls measured.
    single = dict.fromkeys(("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"), "1")
    env = {**os.environ, **single, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}
    done = subprocess.run(
        [*fixed_layout, *valgrind, *command], cwd=tree, env=env, capture_output=True, text=True
    )
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"valgrind run in {tree} failed:\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def per_call(tree: Path, kind: str, calls: int) -> float:
    return (instructions(tree, kind, calls) - instructions(tree, kind, 0)) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--compare-tree", type=Path, help="another checkout, counted too")
    parser.add_argument("--out", default="bench_instructions.json")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "CALLS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        server_calls(args.worker[0], int(args.worker[1]))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("bench_instructions needs valgrind (apt install valgrind)")
    trees = {"paramserver": Path(__file__).resolve().parent.parent}
    if args.compare_tree is not None:
        trees["compared_tree"] = args.compare_tree.resolve()
    counts = {
        name: {kind: per_call(tree, kind, args.calls) for kind in ("fixed", "dynamic")}
        for name, tree in trees.items()
    }
    results: dict[str, Any] = {"machine": machine(), "calls": args.calls}
    results["instructions_per_call"] = counts
    results["dynamic_vs_fixed"] = {n: c["dynamic"] / c["fixed"] for n, c in counts.items()}
    if args.compare_tree is not None:
        results["compared_tree"] = str(args.compare_tree)
        results["paramserver_vs_compared_tree"] = {
            kind: counts["paramserver"][kind] / counts["compared_tree"][kind]
            for kind in ("fixed", "dynamic")
        }
    save(results, args.out)


if __name__ == "__main__":
    main()
