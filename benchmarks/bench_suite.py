"""Bench suite: paramserver against plain PyTorch, DDP and a naive parameter server, side by side.

Two workloads (:mod:`workloads`): ``dlrm``, the sparse model (DLRM, 8 tables x ``--rows`` x 32,
batches of 1024, synthetic click logs with Zipf ids), and ``mlp``, a dense-only MLP of 9.4M
parameters on data a random teacher network labels. On each, the same data and Adagrad for all:

- ``single_process``: plain PyTorch in one process, sparse embedding gradients;
- ``naive_ps``: the textbook parameter server (1 server; the whole model pulled and every gradient
  pushed each step): paramserver serving a copy whose tables are plain dense parameters;
- ``ddp_sparse`` / ``ddp_dense``: DistributedDataParallel over gloo with ``--trainers`` ranks,
  embedding gradients sparse (its fastest form) or dense; the MLP has one form, ``ddp``;
- ``ps_async``, ``ps_sync``, ``ps_ssp`` (SSP bound 2): paramserver, ``--servers`` x ``--trainers``;
- ``ps_allreduce``: paramserver with ``--dense-sync allreduce``: tables async on the servers,
  dense parameters all-reduced among the trainers (gloo), as DDP does.

Every entry runs in new processes of its own, with one torch thread each (see :mod:`systems`);
repeats (``--repeats``) alternate the order of entries and report medians. Reported per entry:
samples/s and its ratio to ``single_process``, bytes per step (push and pull; for DDP, what a
rank hands to all-reduce), peak RSS per trainer process, held-out AUC. Writes JSON (``--out``)
and a markdown table (``--markdown``, also printed).

    .venv/bin/python benchmarks/bench_suite.py --quick    # smoke run: tiny sizes, under a minute
    .venv/bin/python benchmarks/bench_suite.py \\
        --out benchmarks/results/bench_suite.json --markdown benchmarks/results/bench_suite.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from report import machine, save
from systems import START_METHODS, paramserver_job, run_ddp, run_isolated, single_process
from workloads import ClickWorkload, MLPWorkload, Workload, num_parameters

import paramserver as ps

PS_MODES: dict[str, dict[str, Any]] = {
    "ps_async": {"mode": "async"},
    "ps_sync": {"mode": "sync"},
    "ps_ssp": {"mode": "ssp", "ssp_bound": 2},
    # Tables async on the servers, dense parameters all-reduced among the trainers.
    "ps_allreduce": {"mode": "async", "dense_sync": "allreduce"},
}
QUICK = {
    "rows": 10_000,
    "click_batch": 256,
    "steps": 4,
    "naive_steps": 2,
    "ddp_dense_steps": 2,
    "mlp_steps": 3,
    "mlp_batch": 128,
    "mlp_hidden": (256, 256, 256),
    "ps_launcher": "threads",
    "start_method": "forkserver",
}
NOTES = [
    "samples/s: samples trained over the training seconds (first batch to last update; the "
    "slowest trainer's for multi-process systems). x single: over single_process on the same "
    "workload.",
    "push/pull B/step: bytes a paramserver trainer sends/receives per step (mean over trainers).",
    "all-reduce B/step (DDP): gradient bytes one rank hands to all-reduce per step, counted in a "
    "communication hook: dense gradients whole (numel x 4 B); a sparse gradient coalesced, as "
    "gloo sends it (int64 indices + float32 values of its unique rows), plus the dense "
    "layers' gradients. With 2 ranks a ring all-reduce sends and receives about that much each "
    "way; gloo's sparse all-reduce all-gathers every rank's rows.",
    "peak RSS: ru_maxrss of each trainer process (DDP: each rank; single_process: its own fresh "
    "process) right after training, before evaluation.",
    "AUC: held-out, on the final model; systems that train fewer steps (naive_ps, ddp_dense) "
    "reach less. ps_sync matches DDP: both apply the mean gradient of one batch per trainer.",
    "mlp has no tables: its naive_ps is paramserver with 1 server, and DDP has one form.",
]
QUICK_NOTE = (
    "SMOKE RUN (--quick): tiny sizes, paramserver on its threads launcher (its memory figures are "
    "the whole job's one process), processes forked from a fork server: no figure here means "
    "anything."
)


@dataclass(frozen=True)
class Entry:
    workload: Workload
    system: str
    steps: int  # per trainer


def build_workloads(args: argparse.Namespace) -> list[Workload]:
    """The workloads, their streams long enough for the longest entry (each stops at its own
    step count)."""
    click_steps = max(args.steps, args.naive_steps, args.ddp_dense_steps)
    return [
        ClickWorkload(
            name="dlrm",
            rows=args.rows,
            batch_size=args.click_batch,
            train_batches=click_steps * args.trainers,
            lr=0.05,
        ),
        MLPWorkload(
            name="mlp",
            hidden=tuple(args.mlp_hidden),
            batch_size=args.mlp_batch,
            train_batches=args.mlp_steps * args.trainers,
            lr=0.01,  # 0.05 (dlrm's) makes Adagrad's first steps too large for 2048-wide layers
        ),
    ]


def entries_of(workload: Workload, args: argparse.Namespace) -> list[Entry]:
    if isinstance(workload, ClickWorkload):
        return [
            Entry(workload, "single_process", args.steps),
            Entry(workload, "naive_ps", args.naive_steps),
            Entry(workload, "ddp_sparse", args.steps),
            Entry(workload, "ddp_dense", args.ddp_dense_steps),
            *(Entry(workload, system, args.steps) for system in PS_MODES),
        ]
    steps = args.mlp_steps
    return [
        Entry(workload, "single_process", steps),
        Entry(workload, "naive_ps", steps),
        Entry(workload, "ddp", steps),
        *(Entry(workload, system, steps) for system in PS_MODES),
    ]


def run_entry(entry: Entry, args: argparse.Namespace) -> dict[str, Any]:
    workload = entry.workload
    config = ps.TrainConfig(
        servers=args.servers,
        trainers=args.trainers,
        steps=entry.steps,
        optimizer="adagrad",
        lr=workload.lr,
        progress=False,
        threads_per_process=1,
        launcher=args.ps_launcher,
    )
    system, limits = entry.system, (args.timeout, args.start_method)
    if system == "single_process":
        (result,) = run_isolated(single_process, [(workload, config)], *limits)
    elif system == "naive_ps":
        naive = config.replace(servers=1)
        (result,) = run_isolated(paramserver_job, [(workload, naive, True)], *limits)
    elif system in PS_MODES:
        job = config.replace(**PS_MODES[system])
        (result,) = run_isolated(paramserver_job, [(workload, job, False)], *limits)
    else:
        result = run_ddp(workload, config, system == "ddp_sparse", *limits)
    result["samples_per_s"] = result["samples"] / result["seconds"]
    return result


def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    load_before = os.getloadavg()
    suite = build_workloads(args)
    plan = [entry for workload in suite for entry in entries_of(workload, args)]
    if args.only:  # single_process stays: every ratio is to it
        chosen = {"single_process", *args.only.split(",")}
        plan = [e for e in plan if e.system in chosen]
    if args.workloads:
        plan = [e for e in plan if e.workload.name in args.workloads.split(",")]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    # Repeats run the plan forwards, then backwards, and so on: a drifting machine load then
    # hits early and late entries alike. Medians are reported.
    for repeat in range(args.repeats):
        for entry in plan if repeat % 2 == 0 else reversed(plan):
            key = (entry.workload.name, entry.system)
            print(f"[bench_suite] {key[0]} / {key[1]}: {entry.steps} steps", flush=True)
            entry_started = time.perf_counter()
            result = run_entry(entry, args)
            result["entry_wall_s"] = time.perf_counter() - entry_started
            print(
                f"[bench_suite] {key[0]} / {key[1]}: {result['samples_per_s']:,.0f} samples/s, "
                f"AUC {result['metrics']['auc']:.4f}; {result['entry_wall_s']:.1f} s in all",
                flush=True,
            )
            runs.setdefault(key, []).append(result)
    entries = []
    for entry in plan:
        key = (entry.workload.name, entry.system)
        rates = [r["samples_per_s"] for r in runs[key]]
        median = sorted(runs[key], key=lambda r: r["samples_per_s"])[len(rates) // 2]
        single = statistics.median(r["samples_per_s"] for r in runs[(key[0], "single_process")])
        entries.append(
            {
                "workload": key[0],
                "system": key[1],
                "steps_per_trainer": entry.steps,
                **median,
                "speed_vs_single": median["samples_per_s"] / single,
                "all_samples_per_s": rates,
            }
        )
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            **machine(),
            "threads_per_process": 1,  # each entry's processes, not this driver's
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "markdown")},
        "workloads": {w.name: describe(w) for w in suite},
        "entries": entries,
        "seconds": time.perf_counter() - started,
        "notes": [QUICK_NOTE, *NOTES] if args.quick else NOTES,
    }


def describe(workload: Workload) -> dict[str, Any]:
    with torch.device("meta"):  # shapes only: no gigabyte of tables in the driver
        parameters = num_parameters(workload.model())
    info: dict[str, Any] = {
        "kind": type(workload).__name__,
        "parameters": parameters,
        "batch_size": workload.batch_size,
        "lr": workload.lr,
        "optimizer": "adagrad",
        "ceiling_auc": workload.ceiling_auc(),
    }
    if isinstance(workload, ClickWorkload):
        info.update(tables=workload.num_tables, rows=workload.rows, dim=workload.embedding_dim)
    if isinstance(workload, MLPWorkload):
        info.update(layers=[workload.features, *workload.hidden, 1])
    return info


def si_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"## Bench suite, {results['date']}",
        "",
        f"Machine: {m['logical_cpus']} logical CPUs ({m['usable_cpus']} usable), "
        f"{m['platform']}, Python {m['python']}, torch {m['torch']}; "
        f"{m['threads_per_process']} torch thread per process; load average "
        f"{m['load_average_before'][0]:.2f} before, {m['load_average_after'][0]:.2f} after. "
        f"Run took {results['seconds']:.0f} s.",
        "",
    ]
    for name, w in results["workloads"].items():
        shape = (
            f"{w['tables']} tables x {w['rows']:,} rows x {w['dim']}"
            if "tables" in w
            else " -> ".join(str(n) for n in w["layers"])
        )
        lines.append(
            f"- `{name}`: {shape}, {w['parameters']:,} parameters, batch {w['batch_size']}, "
            f"Adagrad lr {w['lr']}; held-out AUC of the ground truth: {w['ceiling_auc']:.4f}"
        )
    lines += [
        "",
        "| workload | system | steps/trainer | samples/s | x single | push B/step | pull B/step "
        "| all-reduce B/step | peak RSS MB/trainer | AUC |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in results["entries"]:
        b = e["bytes_per_step"]
        rss = "/".join(f"{x:,.0f}" for x in e["peak_rss_mb_per_trainer"])
        lines.append(
            f"| {e['workload']} | {e['system']} | {e['steps_per_trainer']} | "
            f"{e['samples_per_s']:,.0f} | {e['speed_vs_single']:.3g} | {si_bytes(b.get('push'))} | "
            f"{si_bytes(b.get('pull'))} | {si_bytes(b.get('allreduce'))} | {rss} | "
            f"{e['metrics']['auc']:.4f} |"
        )
    lines += ["", *(f"- {note}" for note in results["notes"])]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="dlrm: steps per trainer")
    parser.add_argument("--naive-steps", type=int, default=3, help="dlrm: naive_ps's steps")
    parser.add_argument("--ddp-dense-steps", type=int, default=10, help="dlrm: ddp_dense's steps")
    parser.add_argument("--mlp-steps", type=int, default=40, help="mlp: steps per trainer, all")
    parser.add_argument("--rows", type=int, default=1_000_000, help="dlrm: rows per table")
    parser.add_argument("--click-batch", type=int, default=1024, help="dlrm: batch size")
    parser.add_argument("--mlp-batch", type=int, default=512, help="mlp: batch size")
    parser.add_argument(
        "--mlp-hidden", type=int, nargs="+", default=[2048, 2048, 2048], help="mlp: hidden sizes"
    )
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--trainers", type=int, default=2, help="also DDP's ranks")
    parser.add_argument(
        "--ps-launcher",
        choices=("processes", "threads"),
        default="processes",
        help="paramserver's launcher; threads (all roles in one process, so its memory "
        "figures mean nothing) only suits smoke runs",
    )
    parser.add_argument(
        "--start-method",
        choices=START_METHODS,
        default="spawn",
        help="how each entry's processes start: spawn (fresh interpreters) or forkserver "
        "(fast; peak RSS reads ~70 MB low)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of each entry (median)")
    parser.add_argument(
        "--workloads", default=None, help="comma-separated workloads to run (default: both)"
    )
    parser.add_argument(
        "--only",
        default=None,
        help="comma-separated systems to run beside single_process (default: every one)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one entry may run")
    parser.add_argument(
        "--quick", action="store_true", help=f"tiny sizes, a smoke run of every entry: {QUICK}"
    )
    parser.add_argument("--out", default="bench_suite.json", help="JSON results")
    parser.add_argument("--markdown", default=None, help="also write the table here")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    for flag in ("steps", "naive_steps", "ddp_dense_steps", "mlp_steps", "rows", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    results = run_suite(args)
    save(results, args.out, echo=False)
    table = markdown(results)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
