"""TorchRec and FBGEMM as a measured reference: the bench suite's DLRM on their CPU paths, beside
plain PyTorch and paramserver, side by side in one run.

The model and data are the suite's ``dlrm`` workload (:class:`workloads.ClickWorkload`: 8 tables
x ``--rows`` x 32, batches of 1024, synthetic click logs with Zipf ids), one torch thread per
process, one optimizer everywhere (``--optimizer``): Adagrad at the suite's lr (0.05, eps 1e-10;
the default), or plain SGD (no momentum) at the same lr. Every entry starts from the same values:
the dense layers of the suite's seeded DLRM and its tables' row initialisation. Entries:

- ``single_process``: plain PyTorch in one process, sparse embedding gradients, torch.optim's
  Adagrad or SGD (:func:`systems.single_process`, as ``bench_suite.py`` runs it);
- ``ps_async``: paramserver, 1 server + 1 trainer, async (:func:`systems.paramserver_job`), its
  ``adagrad`` or ``sgd`` rule for the dense parameters and the tables alike;
- ``fbgemm_fused``: one process; the 8 tables as one FBGEMM CPU
  ``SplitTableBatchedEmbeddingBagsCodegen`` with ``EXACT_ADAGRAD`` or ``EXACT_SGD`` fused into
  the backward pass (element-wise Adagrad or plain SGD on the rows' summed gradients, the update
  torch.optim's makes in the other entries; FBGEMM's CPU TBE has no Adam), each table looked up
  with one id per sample (sum pooling over bags of length 1, a plain lookup); the dense layers
  with torch.optim's Adagrad or SGD;
- ``torchrec_dmp``: TorchRec's ``DistributedModelParallel`` on ``--ranks`` CPU ranks (gloo on
  127.0.0.1), table-wise sharding (the tables in contiguous blocks, one per rank), the same fused
  update (``apply_optimizer_in_backward(torch.optim.Adagrad)`` or ``(torch.optim.SGD)``, which
  TorchRec maps to ``EXACT_ADAGRAD`` / ``EXACT_SGD``), the dense part data-parallel as DMP makes
  it (DDP, gradients averaged) with torch.optim's Adagrad or SGD. Rank ``r`` trains batches
  ``r, r + ranks, ...`` of the same stream.

Every entry trains on the same ``--steps`` batches (``torchrec_dmp``: ``steps / ranks`` per
rank, each step applying every rank's batch at once). Each runs in new processes of its own
(:func:`systems.run_isolated`); repeats (``--repeats``) alternate the order of entries and report
medians. Reported per entry: samples/s over the training seconds (the slowest rank's), its ratio
to ``ps_async`` and to ``single_process``, CPU seconds per sample summed over every process of
the entry (``cpu_s_per_sample``: from the start of the entry's work to its end, building,
training and evaluating; ``train_cpu_s_per_sample``: the training loop alone, where the entry's
own loop is here to measure), peak RSS per process, held-out AUC. Writes JSON (``--out``).

    .venv/bin/python benchmarks/bench_torchrec.py --quick    # smoke run: tiny sizes, seconds
    .venv/bin/python benchmarks/bench_torchrec.py --repeats 3 \\
        --out benchmarks/results/bench_torchrec.json
    .venv/bin/python benchmarks/bench_torchrec.py --optimizer sgd --repeats 3 \\
        --out benchmarks/results/bench_torchrec_sgd.json

TorchRec and FBGEMM are not dependencies of the project. Where either does not import, the
script says so in one line and runs the entries it can. To install them into .venv on CPU
(their CUDA builds do not load on a CPU-only torch; torchrec pins torchmetrics 1.0.3, below the
project's floor, so its dependencies go in by hand):

    .venv/bin/pip install -c constraints.txt tensordict tqdm pyre-extensions
    .venv/bin/pip install -c constraints.txt --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from peers import OPTIMIZERS, cpu_seconds, fbgemm_fused, probe, run_torchrec
from report import machine, save
from systems import (
    START_METHODS,
    EntryFailed,
    paramserver_job,
    run_isolated,
    single_process,
)
from workloads import ClickWorkload

import paramserver as ps

SYSTEMS = ("single_process", "ps_async", "fbgemm_fused", "torchrec_dmp")
NEEDS = {"fbgemm_fused": ("fbgemm_gpu",), "torchrec_dmp": ("fbgemm_gpu", "torchrec")}
LR = 0.05  # the suite's dlrm lr, for either optimizer
INSTALL = (
    ".venv/bin/pip install -c constraints.txt tensordict tqdm pyre-extensions && "
    ".venv/bin/pip install -c constraints.txt --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0"
)
QUICK = {
    "rows": 10_000,
    "batch": 256,
    "steps": 4,
    "ps_launcher": "threads",
    "start_method": "forkserver",
}
NOTES = [
    "samples/s: samples trained over the training seconds (first batch to last update; the "
    "slowest process's for multi-process entries). x ps / x single: over ps_async / "
    "single_process in this run.",
    "cpu_s_per_sample: user + system CPU seconds of every process of the entry from the start "
    "of its work to its end (building the model, training, evaluating; for ps_async with its "
    "processes launcher also the server and trainer interpreters' start and imports), over the "
    "samples trained. Imports of torchrec / fbgemm_gpu in the entry's own processes are not "
    "counted. train_cpu_s_per_sample: the training loop alone, summed over ranks; measured "
    "only where the loop is this script's (fbgemm_fused, torchrec_dmp).",
    "Optimizer: one everywhere (workload.optimizer), at lr 0.05: Adagrad (eps 1e-10, "
    "element-wise state) or plain SGD (no momentum). FBGEMM and TorchRec apply it to the tables "
    "inside the backward pass (EXACT_ADAGRAD / EXACT_SGD: gradients summed per row first), "
    "torch.optim's to the dense layers.",
    "torchrec_dmp: each step applies every rank's batch at once (dense gradients averaged by "
    "DDP, table gradients summed into the owning rank's tables), so it makes 1/ranks as many "
    "updates as the other entries on the same samples: its AUC differs for that reason too.",
    "peak RSS: ru_maxrss of each training process right after training, before evaluation.",
]
QUICK_NOTE = (
    "SMOKE RUN (--quick): tiny sizes, paramserver on its threads launcher, processes forked "
    "from a fork server: no figure here means anything."
)


# -- the models ---------------------------------------------------------------------------------


def metered(target: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``target(*args)`` (a :mod:`systems` entry) with the CPU seconds it took, its children's
    included."""
    started = cpu_seconds()
    result = target(*args)
    result["cpu_s"] = cpu_seconds() - started
    return result


# -- the driver ---------------------------------------------------------------------------------


def run_entry(system: str, workload: ClickWorkload, args: argparse.Namespace) -> dict[str, Any]:
    config = ps.TrainConfig(
        servers=1,
        trainers=1,
        steps=args.steps,
        mode="async",
        optimizer=args.optimizer,
        lr=workload.lr,
        progress=False,
        threads_per_process=1,
        launcher=args.ps_launcher,
    )
    limits = (args.timeout, args.start_method)
    if system == "single_process":
        (result,) = run_isolated(metered, [(single_process, workload, config)], *limits)
    elif system == "ps_async":
        (result,) = run_isolated(metered, [(paramserver_job, workload, config, False)], *limits)
    elif system == "fbgemm_fused":
        (result,) = run_isolated(fbgemm_fused, [(workload, config)], *limits)
    else:
        result = run_torchrec(workload, config, args.ranks, *limits)
    result["samples_per_s"] = result["samples"] / result["seconds"]
    result["cpu_s_per_sample"] = result["cpu_s"] / result["samples"]
    if "train_cpu_s" in result:
        result["train_cpu_s_per_sample"] = result["train_cpu_s"] / result["samples"]
    return result


def available(systems: Sequence[str], args: argparse.Namespace) -> tuple[list[str], dict]:
    """The systems whose packages import, and what the probe found."""
    needed = {package for system in systems for package in NEEDS.get(system, ())}
    if not needed:
        return list(systems), {}
    try:
        (found,) = run_isolated(probe, [()], args.timeout, args.start_method)
    except EntryFailed as error:
        found = {package: f"the import crashed its process ({error})" for package in needed}
    missing = {p: why for p, why in found.items() if p in needed and not why.startswith("ok")}
    if missing:
        skipped = [s for s in systems if set(NEEDS.get(s, ())) & set(missing)]
        reasons = "; ".join(f"{p}: {why}" for p, why in missing.items())
        print(
            f"[bench_torchrec] skipping {', '.join(skipped)}: {reasons}. "
            f"Install into .venv (CPU builds): {INSTALL}",
            flush=True,
        )
    return [s for s in systems if not set(NEEDS.get(s, ())) & set(missing)], found


def summarise(plan: list[str], runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each entry's median run (by samples/s), with its ratios to the references' medians."""

    def median_rate(system: str) -> float | None:
        if system not in runs:
            return None
        return statistics.median(r["samples_per_s"] for r in runs[system])

    references = {"ps_async": median_rate("ps_async"), "single": median_rate("single_process")}
    entries = []
    for system in plan:
        rates = [r["samples_per_s"] for r in runs[system]]
        median = sorted(runs[system], key=lambda r: r["samples_per_s"])[len(rates) // 2]
        ratios = {
            f"speed_vs_{name}": median["samples_per_s"] / rate if rate else None
            for name, rate in references.items()
        }
        entries.append({"system": system, **median, **ratios, "all_samples_per_s": rates})
    return entries


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    load_before = os.getloadavg()
    workload = ClickWorkload(
        name="dlrm", rows=args.rows, batch_size=args.batch, train_batches=args.steps, lr=LR
    )
    chosen = [s for s in SYSTEMS if not args.only or s in args.only.split(",")]
    plan, packages = available(chosen, args)
    runs: dict[str, list[dict[str, Any]]] = {}
    # Forwards, then backwards, and so on: a drifting load hits early and late entries alike.
    for repeat in range(args.repeats):
        for system in plan if repeat % 2 == 0 else reversed(plan):
            print(f"[bench_torchrec] {system}: {args.steps} batches", flush=True)
            entry_started = time.perf_counter()
            result = run_entry(system, workload, args)
            result["entry_wall_s"] = time.perf_counter() - entry_started
            print(
                f"[bench_torchrec] {system}: {result['samples_per_s']:,.0f} samples/s, "
                f"{result['cpu_s_per_sample'] * 1e6:.1f} CPU us/sample, AUC "
                f"{result['metrics']['auc']:.4f}; {result['entry_wall_s']:.1f} s in all",
                flush=True,
            )
            runs.setdefault(system, []).append(result)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            **machine(),
            "threads_per_process": 1,  # each entry's processes, not this driver's
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "packages": packages,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "workload": {
            "tables": workload.num_tables,
            "rows": workload.rows,
            "dim": workload.embedding_dim,
            "batch_size": workload.batch_size,
            "batches": workload.train_batches,
            "lr": workload.lr,
            "optimizer": args.optimizer,
            "fused_table_optimizer": f"EXACT_{args.optimizer.upper()}",  # FBGEMM's, TorchRec's
            "ceiling_auc": workload.ceiling_auc(),
        },
        "skipped": [s for s in chosen if s not in plan],
        "entries": summarise(plan, runs),
        "seconds": time.perf_counter() - started,
        "notes": [QUICK_NOTE, *NOTES] if args.quick else NOTES,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="batches every entry trains on")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows per table")
    parser.add_argument("--batch", type=int, default=1024, help="batch size")
    parser.add_argument("--ranks", type=int, default=2, help="torchrec_dmp's ranks")
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adagrad",
        help=f"every entry's update rule, dense layers and tables, at lr {LR}",
    )
    parser.add_argument(
        "--ps-launcher",
        choices=("processes", "threads"),
        default="processes",
        help="paramserver's launcher; threads (one process) only suits smoke runs",
    )
    parser.add_argument("--start-method", choices=START_METHODS, default="spawn")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each entry (median)")
    parser.add_argument(
        "--only", default=None, help=f"comma-separated entries to run (default: {SYSTEMS})"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one entry may run")
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK}")
    parser.add_argument("--out", default="bench_torchrec.json", help="JSON results")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    for flag in ("steps", "rows", "batch", "ranks", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1")
    if args.steps % args.ranks:
        parser.error(f"--steps must be a multiple of --ranks ({args.ranks}): ranks step together")
    if args.only and (unknown := set(args.only.split(",")) - set(SYSTEMS)):
        parser.error(f"--only: unknown entries {sorted(unknown)}; choose from {SYSTEMS}")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    results = run_bench(args)
    save(results, args.out)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
