"""Instructions a trainer executes per training step, counted by valgrind: a figure the host's
other tenants do not move (CPU seconds move by up to 2x with them).

A job of 1 server and 1 trainer (async, SGD, the processes launcher) trains ``bench_field.py``'s
workloads: ``tiny`` (one ``nn.Embedding`` of 1,000 x 16 and a linear layer, batch 32: what a step
costs beyond its forward and backward) and ``bags`` (a DLRM of 10 bag tables, batch 128). Only
the trainer's process runs under valgrind's cachegrind (the launcher starts the workers with
``sys.executable``, which this script points at a wrapper for the trainer's rank); the count is
the whole process's, and a step's is the difference between a run of ``--steps`` more steps and
a run of ``--base-steps``, over the extra steps (start-up and the job's end drop out). The same
for ``--compare-tree`` (another checkout with its compiled loops built in place), side by side.
Its forward and backward in one plain process are counted the same way, for what the step
costs beyond them.

Needs valgrind (``apt install valgrind``); each count takes a few minutes.

    .venv/bin/python benchmarks/bench_step_instructions.py --compare-tree /tmp/prev \\
        --out benchmarks/results/bench_step_instructions.json
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from report import machine, save

WORKLOADS = {"tiny": 32, "bags": 128}
_COUNT = re.compile(r"^summary:\s+(\d+)", re.MULTILINE)


def job_worker(workload: str, steps: int, wrapper: str) -> None:
    """In this process: the job, its workers started through ``wrapper`` (see the module
    docstring)."""
    import torch
    from bench_field import config, loss_fn
    from field_models import Workload

    import paramserver as ps

    torch.set_num_threads(1)
    work = Workload(workload, WORKLOADS[workload], steps)
    sys.executable = wrapper  # the launcher starts each worker with it
    job = config(
        servers=1, trainers=1, gather_model=False, rpc_timeout=600.0, trainer_timeout=600.0,
        heartbeat_interval=5.0,
    )  # fmt: skip
    ps.train(work.model, work.batches, loss_fn, job)


def plain_worker(workload: str, steps: int) -> None:
    """In this process: the workload's forward and backward, ``steps`` times."""
    import torch
    from bench_field import loss_fn
    from field_models import Workload

    torch.set_num_threads(1)
    work = Workload(workload, WORKLOADS[workload], steps)
    model = work.model()
    for inputs, target in work.batches(0, 1):
        output = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
        loss_fn(output, target).backward()
        model.zero_grad()  # left to add up, sparse gradients grow by every step's, and so cost


def environment(tree: Path) -> dict[str, str]:
    # One thread per pool: an idle BLAS or OpenMP worker spins, and its spinning counts.
    single = dict.fromkeys(("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"), "1")
    return {**os.environ, **single, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}


def valgrind_command(out_file: Path) -> list[str]:
    fixed_layout = ["setarch", os.uname().machine, "-R"] if shutil.which("setarch") else []
    return [
        *fixed_layout, "valgrind", "--tool=cachegrind", "--cache-sim=no",
        f"--cachegrind-out-file={out_file}",
    ]  # fmt: skip


def counted(out_file: Path) -> int:
    found = _COUNT.search(out_file.read_text())
    if found is None:
        raise SystemExit(f"no instruction count in {out_file}")
    return int(found.group(1))


def trainer_instructions(tree: Path, workload: str, steps: int) -> int:
    """The trainer process's instructions in a job of ``steps`` steps run from ``tree``."""
    script = tree / "benchmarks" / Path(__file__).name
    with tempfile.TemporaryDirectory(prefix="step-instructions-") as work:
        out_file = Path(work) / "trainer.cachegrind"
        wrapper = Path(work) / "python"
        # The worker's arguments are "-m paramserver.launch.worker SPEC RANK": rank 1 is the
        # trainer of a job of one server.
        counting = " ".join(valgrind_command(out_file))
        wrapper.write_text(
            "#!/bin/sh\n"
            f'if [ "$4" = "1" ]; then exec {counting} {sys.executable} "$@"; fi\n'
            f'exec {sys.executable} "$@"\n'
        )
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
        command = [sys.executable, str(script), "--job-worker", workload, str(steps), str(wrapper)]
        done = subprocess.run(command, cwd=tree, env=environment(tree), capture_output=True)
        if done.returncode != 0 or not out_file.exists():
            raise SystemExit(f"the job in {tree} failed:\n{done.stderr.decode()[-3000:]}")
        return counted(out_file)


def plain_instructions(tree: Path, workload: str, steps: int) -> int:
    script = tree / "benchmarks" / Path(__file__).name
    with tempfile.TemporaryDirectory(prefix="step-instructions-") as work:
        out_file = Path(work) / "plain.cachegrind"
        command = [sys.executable, str(script), "--plain-worker", workload, str(steps)]
        done = subprocess.run(
            [*valgrind_command(out_file), *command],
            cwd=tree,
            env=environment(tree),
            capture_output=True,
        )
        if done.returncode != 0:
            raise SystemExit(f"the plain run in {tree} failed:\n{done.stderr.decode()[-3000:]}")
        return counted(out_file)


def per_step(count: Any, tree: Path, workload: str, base: int, extra: int) -> float:
    return (count(tree, workload, base + extra) - count(tree, workload, base)) / extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-steps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100, help="the longer run's extra steps")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--compare-tree", type=Path, help="another checkout, counted too")
    parser.add_argument("--out", default="bench_step_instructions.json")
    parser.add_argument("--job-worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--plain-worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job_worker is not None:
        workload, steps, wrapper = args.job_worker
        job_worker(workload, int(steps), wrapper)
        return
    if args.plain_worker is not None:
        plain_worker(args.plain_worker[0], int(args.plain_worker[1]))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("bench_step_instructions needs valgrind (apt install valgrind)")
    here = Path(__file__).resolve().parent.parent
    trees = {"paramserver": here}
    if args.compare_tree is not None:
        trees["compared_tree"] = args.compare_tree.resolve()
    steps = (args.base_steps, args.steps)
    results: dict[str, Any] = {"machine": machine(), "base_steps": args.base_steps}
    results["steps"] = args.steps
    for workload in args.workloads:
        plain = per_step(plain_instructions, here, workload, *steps)
        entry: dict[str, Any] = {"plain_forward_backward": plain}
        for name, tree in trees.items():
            trainer = per_step(trainer_instructions, tree, workload, *steps)
            entry[name] = {"trainer": trainer, "trainer_beyond_forward_backward": trainer - plain}
        if args.compare_tree is not None:
            entry["compared_tree_vs_paramserver"] = {
                key: entry["compared_tree"][key] / entry["paramserver"][key]
                for key in entry["paramserver"]
            }
        results[workload] = entry
    if args.compare_tree is not None:
        results["compared_tree"] = str(args.compare_tree)
    save(results, args.out)


if __name__ == "__main__":
    main()
