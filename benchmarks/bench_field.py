"""Models as others write them, and a step's fixed cost: paramserver against one plain process.

Workloads (SGD everywhere, one torch thread per process):

- ``bags``: a DLRM written the way facebookresearch/dlrm writes it (not its code): 10
  ``nn.EmbeddingBag`` tables of 2k-100k rows sized by a numpy array, dim 16, sum bags of 1-10
  ids given by offsets, weights set from numpy, a dot interaction, at batch 128 and 2048;
- ``tiny``: one ``nn.Embedding`` of 1,000 x 16 and a linear layer at batch 32: what a step costs
  beyond its forward and backward.

Systems, each in fresh processes (``systems.run_isolated``): ``plain``, one PyTorch process
(``paramserver.baseline``, sparse gradients); ``ps``, paramserver with 1 server and 1 trainer
(async, the local launcher); and ``ps_grouped``, the same computing ``--steps-per-call`` steps
from each pull (one message per that many steps). Each runs twice, for ``--steps`` and for
``--steps`` x 5, and its figures are the differences: samples/s is extra samples over extra
training seconds, and CPU per sample is extra CPU seconds (the launcher and every worker
process, or the one process) over extra samples, so start-up and the job's end drop out. CPU
per sample moves far less with the host's other tenants than samples/s does.

For ``tiny`` it also reports, per step: the CPU of plain PyTorch's forward and backward alone,
and the chief trainer's process CPU over its loop (``paramserver.run``; every thread of the
process: the RPC's included), one pull per step and grouped; their difference is the trainer's
fixed cost per step.

    .venv/bin/python benchmarks/bench_field.py --out benchmarks/results/bench_field.json
    .venv/bin/python benchmarks/bench_field.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import datetime
import functools
import resource
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from field_models import Workload
from report import machine, save
from systems import run_isolated
from torch import Tensor

import paramserver as ps
from paramserver.baseline import train_single_process

LONGER = 5  # the longer run's steps over the shorter's


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return F.binary_cross_entropy_with_logits(output, target)


def config(**overrides: Any) -> ps.TrainConfig:
    return ps.TrainConfig(
        optimizer="sgd", lr=0.1, progress=False, threads_per_process=1, **overrides
    )


def cpu_seconds() -> float:
    """This process's CPU and that of its children that have ended (the job's workers)."""
    own, children = (
        resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def plain(workload: Workload) -> dict[str, float]:
    torch.set_num_threads(1)
    cpu = cpu_seconds()
    _, stats = train_single_process(
        workload.model, workload.batches, loss_fn, config(servers=1, trainers=1)
    )
    return {"samples": stats["samples"], "seconds": stats["seconds"], "cpu_s": cpu_seconds() - cpu}


def paramserver(workload: Workload, steps_per_call: int = 1) -> dict[str, float]:
    torch.set_num_threads(1)
    cpu = cpu_seconds()
    job = config(servers=1, trainers=1, gather_model=False, steps_per_call=steps_per_call)
    result = ps.train(workload.model, workload.batches, loss_fn, job)
    assert result is not None
    summary = result.summary
    return {
        "samples": summary["samples"],
        "seconds": summary["train_seconds"],
        "cpu_s": cpu_seconds() - cpu,
    }


def forward_backward_cpu(workload: Workload) -> dict[str, float]:
    """Plain PyTorch's forward and backward alone, per step (no optimizer)."""
    torch.set_num_threads(1)
    model = workload.model()
    batches = list(workload.batches(0, 1))
    started = time.process_time()
    for inputs, target in batches:
        loss_fn(model(inputs), target).backward()
    return {"cpu_per_step_s": (time.process_time() - started) / len(batches)}


def trainer_loop_cpu(workload: Workload, steps_per_call: int = 1) -> dict[str, float]:
    """The chief trainer's process CPU and wall time per step over its loop (1+1, async)."""

    def loop(ctx: ps.TrainContext) -> dict[str, float]:
        cpu, wall, steps = time.process_time(), time.perf_counter(), 0
        for inputs, target in ctx.batches(workload.batches(ctx.rank, ctx.num_trainers)):
            loss = loss_fn(ctx.model(inputs), target)
            loss.backward()
            ctx.step(loss)
            steps += 1
        return {
            "cpu_per_step_s": (time.process_time() - cpu) / steps,
            "wall_per_step_s": (time.perf_counter() - wall) / steps,
        }

    torch.set_num_threads(1)
    job = config(servers=1, trainers=1, gather_model=False, steps_per_call=steps_per_call)
    result = ps.run(workload.model, loop, job)
    assert result is not None
    return dict(result.value)


def differential(
    system: Any, workload: Workload, factor: int, timeout_s: float
) -> dict[str, float]:
    """``system``'s samples/s and CPU per sample from a run of ``workload`` and one
    ``factor`` times longer (see the module docstring)."""
    short = run_isolated(system, [(workload,)], timeout_s)[0]
    long = run_isolated(system, [(workload.longer(factor),)], timeout_s)[0]
    samples = long["samples"] - short["samples"]
    return {
        "samples_per_s": samples / (long["seconds"] - short["seconds"]),
        "cpu_us_per_sample": 1e6 * (long["cpu_s"] - short["cpu_s"]) / samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=100, help="steps of the shorter run")
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs; medians reported")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few steps, one repeat")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument(
        "--steps-per-call", type=int, default=8, help="steps from one pull for ps_grouped"
    )
    parser.add_argument("--out", default="bench_field.json")
    args = parser.parse_args()
    grouped = functools.partial(paramserver, steps_per_call=args.steps_per_call)
    steps, repeats = (5, 1) if args.quick else (args.steps, args.repeats)
    workloads = [
        Workload("bags", 128, steps),
        Workload("bags", 2048, max(steps // 4, 2)),
        Workload("tiny", 32, steps * 20),
    ]
    entries: dict[str, dict[str, Any]] = {}
    for workload in workloads:
        systems = [("plain", plain), ("ps", paramserver), ("ps_grouped", grouped)]
        runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in systems}
        for repeat in range(repeats):  # alternate which system runs first
            for name, system in systems if repeat % 2 == 0 else systems[::-1]:
                runs[name].append(differential(system, workload, LONGER, args.timeout))
        entry: dict[str, Any] = {"runs": runs}
        for name, figures in runs.items():
            entry[name] = {key: statistics.median(f[key] for f in figures) for key in figures[0]}
        entry["ratio"] = {
            name: {
                "samples_per_s": entry[name]["samples_per_s"] / entry["plain"]["samples_per_s"],
                "cpu_per_sample": entry[name]["cpu_us_per_sample"]
                / entry["plain"]["cpu_us_per_sample"],
            }
            for name in ("ps", "ps_grouped")
        }
        if workload.name == "tiny":
            longer = workload.longer(LONGER)
            fwd_bwd = run_isolated(forward_backward_cpu, [(longer,)], args.timeout)[0]
            entry["per_step_us"] = {"forward_backward_cpu": 1e6 * fwd_bwd["cpu_per_step_s"]}
            for name, steps_per_call in (("ps", 1), ("ps_grouped", args.steps_per_call)):
                runs = [(longer, steps_per_call)]
                (trainer,) = run_isolated(trainer_loop_cpu, runs, args.timeout)
                entry["per_step_us"][name] = {
                    "trainer_cpu": 1e6 * trainer["cpu_per_step_s"],
                    "trainer_wall": 1e6 * trainer["wall_per_step_s"],
                    "trainer_cpu_beyond_forward_backward": 1e6
                    * (trainer["cpu_per_step_s"] - fwd_bwd["cpu_per_step_s"]),
                }
        entries[f"{workload.name}_b{workload.batch_size}"] = entry
    save(
        {
            "benchmark": "bench_field",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": machine(),
            "steps": steps,
            "repeats": repeats,
            "steps_per_call": args.steps_per_call,
            "entries": entries,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
