"""Reliability: local jobs with random faults, against a fault-free run of the same job.

Fault classes (each ``--trials`` times, at a random moment of the job):
- ``trainer_kill``: SIGKILL of trainer 1 (async mode); the job must finish without it.
- ``freeze``: SIGSTOP of trainer 1 for ``--trainer-timeout`` + 2 s, then SIGCONT; it must be
  declared departed, refused when it wakes, and the job must finish.
- ``server_kill``: SIGKILL of server 1 with ``--max-restarts 1`` and a checkpoint every 50
  steps; the job must restart from the newest checkpoint and finish.
- ``stuck``: trainer 1's data blocks for good at a random batch (a hung read) while its process
  and heartbeats live; it must be declared departed after ``--stall-timeout`` and the job must
  finish, its process gone.

Per class it prints trials, jobs finished, detection time (trainers: the silence after which
servers declared it departed; servers: from the kill to the launcher's restart), steps lost
(server kill: the chief's steps past the checkpoint it resumed from) and held-out AUC against
the fault-free run. Job: the default model on ``--train-batches`` batches of 512, 2 servers + 3
trainers, processes launcher.

    .venv/bin/python benchmarks/reliability.py --trials 3 --out benchmarks/results/reliability.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch.nn.functional as F
from report import save

import paramserver as ps
from paramserver.checkpoint import load_latest
from paramserver.data.synthetic import SyntheticClickLogs, SyntheticSpec
from paramserver.metrics import evaluate_binary
from paramserver.models.dlrm import DLRM
from paramserver.types import Progress

TRAINER_TIMEOUT = 3.0
STALL_TIMEOUT = 2 * TRAINER_TIMEOUT


def stuck_at(batches: Any, victim: int, at: int) -> Any:
    """``batches`` (a data function), but trainer ``victim``'s blocks for good at batch ``at``."""

    def data(trainer: int, num_trainers: int) -> Any:
        for index, batch in enumerate(batches(trainer, num_trainers)):
            if trainer == victim and index == at:
                time.sleep(24 * 3600)
            yield batch

    return data


def job_pids() -> dict[int, int]:
    """rank -> pid of the workers this process's launcher started."""
    marker = f"PARAMSERVER_LAUNCHER_PID={os.getpid()}".encode()
    pids = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"paramserver.launch.worker" in argv:
            pids[int(argv[argv.index(b"paramserver.launch.worker") + 2])] = int(entry.name)
    return pids


def run_trial(kind: str, rng: random.Random, args: argparse.Namespace) -> dict[str, Any]:
    spec = SyntheticSpec(train_batches=args.train_batches)
    data = SyntheticClickLogs(spec)
    root = tempfile.mkdtemp(prefix="reliability-")
    config = ps.TrainConfig(
        servers=2, trainers=3, progress=False, heartbeat_interval=0.5,
        trainer_timeout=TRAINER_TIMEOUT, checkpoint_dir=root,
        checkpoint_every=50 if kind == "server_kill" else None,
        max_restarts=1 if kind == "server_kill" else 0, stall_timeout=STALL_TIMEOUT,
    )  # fmt: skip
    chief_steps = [0]
    outcome: dict[str, Any] = {}

    def progress(p: Progress) -> None:
        if p.trainer == 0:
            chief_steps[0] = p.steps

    steps_per_trainer = args.train_batches // 3
    batches = data.train_batches
    if kind == "stuck":
        batches = stuck_at(batches, 1, int(rng.uniform(0.2, 0.7) * steps_per_trainer))

    def job() -> None:
        try:
            model_fn = lambda: DLRM(table_rows=[spec.rows_per_table] * spec.num_tables)  # noqa: E731
            outcome["result"] = ps.train(
                model_fn, batches, F.binary_cross_entropy_with_logits, config, progress
            )
        except Exception as error:
            outcome["error"] = f"{type(error).__name__}: {error}"

    thread = threading.Thread(target=job)
    thread.start()
    trial: dict[str, Any] = {"kind": kind}
    if kind not in ("none", "stuck"):
        at = rng.uniform(0.2, 0.7) * steps_per_trainer
        while chief_steps[0] < at and thread.is_alive():
            time.sleep(0.01)
        if kind == "server_kill":
            while load_latest(root) is None and thread.is_alive():
                time.sleep(0.01)
        rank = 1 if kind == "server_kill" else 2 + 1  # server 1, or trainer 1
        pid = job_pids()[rank]
        latest = load_latest(root)
        trial["at_step"] = chief_steps[0]
        os.kill(pid, signal.SIGSTOP if kind == "freeze" else signal.SIGKILL)
        killed = time.monotonic()
        if kind == "freeze":
            time.sleep(TRAINER_TIMEOUT + 2)
            os.kill(pid, signal.SIGCONT)
        if kind == "server_kill" and latest is not None:
            trial["steps_lost"] = chief_steps[0] - latest.step
            before = set(job_pids().values())
            while thread.is_alive() and not (set(job_pids().values()) - before):
                time.sleep(0.01)
            trial["detected_s"] = time.monotonic() - killed  # until the restart began
    thread.join()
    trial["processes_left"] = len(job_pids())  # the launcher must have stopped every one
    if "error" in outcome:
        trial.update(finished=False, error=outcome["error"])
        return trial
    result = outcome["result"]
    summary = result.summary
    trial.update(
        finished=True,
        auc=evaluate_binary(result.model, [b for b, _ in data.eval_batches()])["auc"],
        departed=summary["departed_trainers"],
        restarts=len(summary.get("restarts", [])),
    )
    if kind in ("trainer_kill", "freeze", "stuck"):
        trial["detected_s"] = summary["departed_after_s"].get("1")
    return trial


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--train-batches", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="reliability.json")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    baseline = run_trial("none", rng, args)
    classes: dict[str, Any] = {}
    for kind in ("trainer_kill", "freeze", "server_kill", "stuck"):
        trials = [run_trial(kind, rng, args) for _ in range(args.trials)]
        done = [t for t in trials if t["finished"]]
        detected = [t["detected_s"] for t in trials if t.get("detected_s") is not None]
        lost = [t["steps_lost"] for t in trials if "steps_lost" in t]
        classes[kind] = {
            "trials": len(trials),
            "finished": len(done),
            "detection_s_median": statistics.median(detected) if detected else None,
            "steps_lost_max": max(lost) if lost else 0,
            "processes_left": sum(t["processes_left"] for t in trials),
            "auc_minus_fault_free": [t["auc"] - baseline["auc"] for t in done],
            "runs": trials,
        }
        print(kind, json.dumps({k: v for k, v in classes[kind].items() if k != "runs"}), flush=True)
    report = {
        "fault_free_auc": baseline["auc"],
        "trainer_timeout_s": TRAINER_TIMEOUT,
        "stall_timeout_s": STALL_TIMEOUT,
        **classes,
    }
    save(report, args.out, echo=False)


if __name__ == "__main__":
    main()
