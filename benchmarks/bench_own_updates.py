"""What a prefetching trainer's own updates cost, function by function: the Criteo job with
``--prefetch-own-updates`` (the default) and without, side by side.

On one file of ``--lines`` lines written by ``write_synthetic_criteo``, ``paramserver train
--dataset criteo:FILE --servers 1 --trainers 1 --batch-size 512``, each way ``--repeats``
times in alternation. Each worker process imports a ``sitecustomize`` (put first on its
``PYTHONPATH``) that wraps the functions of :data:`FUNCTIONS` and adds up each one's thread CPU
(``time.thread_time``: not the time its thread waits for the GIL or a lock), or its wall time
for those of :data:`WALL` (waits), and writes the totals when the process exits. Nested
functions count inside their callers too.

Reported per process (trainer, server), per function: microseconds per training step with
own updates and without, medians over the repetitions, and the job's samples/s each way.

    .venv/bin/python benchmarks/bench_own_updates.py --out benchmarks/results/bench_own_updates.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from report import machine, save

from paramserver.data.criteo import write_synthetic_criteo

# (module, class or None, function): what the workers time.
FUNCTIONS = [
    ("paramserver.trainer.stages", "StepCalls", "begin"),
    ("paramserver.trainer.stages", "StepCalls", "ask"),
    ("paramserver.trainer.stages", "StepCalls", "send"),
    ("paramserver.trainer.client", "InFlight", "_answers"),
    ("paramserver.trainer.client", "InFlight", "_assemble"),
    ("paramserver.trainer.rowstate", None, "joined_state"),
    ("paramserver.trainer.ownupdates", "OwnUpdates", "apply"),
    ("paramserver.trainer.ownupdates", "OwnUpdates", "rows_to_ask"),
    ("paramserver.trainer.ownupdates", "OwnUpdates", "_apply_rows"),
    ("paramserver.trainer.ownupdates", "OwnUpdates", "_apply_dense"),
    ("paramserver.native", None, "own_rows"),
    ("paramserver.server.shard", "ServerShard", "read"),
    ("paramserver.server.shard", "ServerShard", "apply"),
    ("paramserver.server.shard", "ServerShard", "_state_blocks"),
    ("paramserver.store.store", "Store", "read"),
    ("paramserver.store.store", "Store", "read_dense"),
    ("paramserver.wire.frames", None, "encode"),
    ("paramserver.wire.frames", None, "decode"),
]
WALL = {"InFlight._answers"}  # a wait: its wall time

# Written as sitecustomize.py: wraps FUNCTIONS as their modules are imported, writes the
# totals as JSON to $OWN_UPDATES_OUT.<pid>.json at exit.
SITECUSTOMIZE = """
import atexit, builtins, functools, json, os, sys, time

FUNCTIONS = {functions!r}
WALL = {wall!r}
totals = {{}}
wrapped = set()


def timed(key, function):
    clock = time.perf_counter if key in WALL else time.thread_time

    @functools.wraps(function)
    def run(*args, **kwargs):
        started = clock()
        try:
            return function(*args, **kwargs)
        finally:
            total = totals.setdefault(key, [0.0, 0])
            total[0] += clock() - started
            total[1] += 1

    return run


def wrap_loaded():
    for module, owner_name, name in FUNCTIONS:
        loaded = sys.modules.get(module)
        if (module, owner_name, name) in wrapped or loaded is None:
            continue
        owner = getattr(loaded, owner_name, None) if owner_name else loaded
        if owner is None or not hasattr(owner, name):  # a module still being imported
            continue
        key = f"{{owner_name or module.rsplit('.', 1)[1]}}.{{name}}"
        function = timed(key, getattr(owner, name))
        if owner_name and isinstance(owner.__dict__.get(name), staticmethod):
            function = staticmethod(function)
        setattr(owner, name, function)
        wrapped.add((module, owner_name, name))


imported = builtins.__import__


def importing(*args, **kwargs):
    module = imported(*args, **kwargs)
    if len(wrapped) < len(FUNCTIONS):
        wrap_loaded()
    return module


builtins.__import__ = importing


@atexit.register
def write():
    out = os.environ.get("OWN_UPDATES_OUT")
    if totals and out:
        with open(f"{{out}}.{{os.getpid()}}.json", "w") as file:
            json.dump(totals, file)
"""


def run_job(data: Path, hooks: Path, work: Path, own_updates: bool) -> dict[str, Any]:
    """One job: its samples/s and steps, and per process the functions' totals."""
    out = work / ("on" if own_updates else "off")
    summary = work / "summary.json"
    for old in work.glob(f"{out.name}.*.json"):
        old.unlink()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]),
        "OWN_UPDATES_OUT": str(out),
    }
    flags = [] if own_updates else ["--no-prefetch-own-updates"]
    subprocess.run(
        [sys.executable, "-m", "paramserver", "train", "--dataset", f"criteo:{data}",
         "--servers", "1", "--trainers", "1", "--batch-size", "512", "--no-progress",
         "--summary-json", str(summary), *flags],
        env=env, check=True, capture_output=True, timeout=1800,
    )  # fmt: skip
    job = json.loads(summary.read_text())
    processes: dict[str, dict[str, float]] = {}
    for path in work.glob(f"{out.name}.*.json"):
        totals = json.loads(path.read_text())
        role = "trainer" if "StepCalls.begin" in totals else "server"
        processes[role] = {
            key: 1e6 * seconds / job["steps"] for key, (seconds, _) in totals.items()
        }
    return {"samples_per_s": job["samples_per_s"], "steps": job["steps"], "us_per_step": processes}


def medians(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per process and function, the median over ``runs`` of its microseconds a step."""
    found: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        for role, functions in run["us_per_step"].items():
            for key, value in functions.items():
                found.setdefault(role, {}).setdefault(key, []).append(value)
    return {
        role: {key: statistics.median(values) for key, values in functions.items()}
        for role, functions in found.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=300_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        data = work / "criteo.txt"
        write_synthetic_criteo(data, args.lines)
        hooks = work / "hooks"
        hooks.mkdir()
        (hooks / "sitecustomize.py").write_text(
            SITECUSTOMIZE.format(functions=FUNCTIONS, wall=WALL)
        )
        for repeat in range(args.repeats):
            order = [True, False] if repeat % 2 == 0 else [False, True]
            for own_updates in order:
                run = run_job(data, hooks, work, own_updates)
                runs["on" if own_updates else "off"].append(run)
                print(
                    f"own updates {'on ' if own_updates else 'off'}: "
                    f"{run['samples_per_s']:,.0f} samples/s",
                    flush=True,
                )
    on, off = medians(runs["on"]), medians(runs["off"])
    table = {
        role: {
            key: {"on": on[role].get(key, 0.0), "off": off.get(role, {}).get(key, 0.0)}
            for key in sorted(on[role], key=lambda k: -on[role][k])
        }
        for role in on
    }
    for role, functions in table.items():
        print(f"\n{role}: us per step, own updates on / off (difference)")
        for key, value in functions.items():
            difference = value["on"] - value["off"]
            print(f"  {key:28s} {value['on']:8.0f} {value['off']:8.0f}  ({difference:+.0f})")
    samples = {way: statistics.median(r["samples_per_s"] for r in runs[way]) for way in runs}
    print(f"\nsamples/s: on {samples['on']:,.0f}, off {samples['off']:,.0f}")
    if args.out is not None:
        results = {
            "benchmark": "bench_own_updates",
            "machine": machine(),
            "lines": args.lines,
            "repeats": args.repeats,
            "median_samples_per_s": samples,
            "median_us_per_step": table,
            "runs": runs,
        }
        save(results, str(args.out), echo=False)


if __name__ == "__main__":
    main()
