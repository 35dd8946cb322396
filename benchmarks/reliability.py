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
- ``recover_sync``, ``recover_async``: SIGKILL of server 1 in a job with ``--recover`` (its
  change log every second, a checkpoint every 50 steps): it must restart alone and the job
  finish having lost no update: every row's and dense value's count of updates in the final
  checkpoint as in an uninterrupted run of the same mode, and in sync mode every tensor of it
  bitwise equal. ``paused_s``: from the kill to the chief's next step (progress comes every
  0.2 s); ``restore_s``: the restarted server's rebuild from its checkpoint and log.

Per class it prints trials, jobs finished, detection time (trainers: the silence after which
servers declared it departed; servers: from the kill to the launcher's restart), steps lost
(server kill: the chief's steps past the checkpoint it resumed from) and held-out AUC against
the fault-free run. Job: the default model on ``--train-batches`` batches of 512, 2 servers + 3
trainers, processes launcher.

    .venv/bin/python benchmarks/reliability.py --trials 3 --out benchmarks/results/reliability.json
    .venv/bin/python benchmarks/reliability.py --kinds recover_sync recover_async --trials 10 \
        --out benchmarks/results/reliability_recover.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
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
from paramserver.checkpoint import load_latest, open_checkpoint
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


RECOVER_KINDS = ("recover_sync", "recover_async")


def final_tensors(root: str) -> dict[str, Any]:
    """Every tensor of the servers' parts of the job's final checkpoint."""
    found = load_latest(root)
    assert found is not None and found.meta.get("final"), "no final checkpoint"
    found = open_checkpoint(found.directory)
    tensors = {}
    for name in (n for n in found.part_names if n.startswith("server-")):
        part, _ = found.read_part(name)
        tensors.update({f"{name}/{key}": value for key, value in part.items()})
    return tensors


def update_counts(tensors: dict[str, Any]) -> dict[str, Any]:
    return {n: v for n, v in tensors.items() if n.endswith("/steps") or n.endswith("/step")}


def recover_compared(trial: dict[str, Any], root: str, reference: dict[str, Any] | None) -> None:
    """What a recover trial lost against the uninterrupted run's final checkpoint."""
    if reference is None:
        return
    ended = final_tensors(root)
    counts, expected = update_counts(ended), update_counts(reference)
    trial["updates_applied"] = int(sum(int(v.sum()) for v in counts.values()))
    trial["updates_lost"] = (
        int(sum(int(v.sum()) for v in expected.values())) - trial["updates_applied"]
    )
    trial["update_counts_equal"] = counts.keys() == expected.keys() and all(
        bool((counts[n] == expected[n]).all()) for n in counts
    )
    trial["bitwise_equal"] = ended.keys() == reference.keys() and all(
        bool((ended[n] == reference[n]).all()) for n in ended
    )


def run_trial(
    kind: str,
    rng: random.Random,
    args: argparse.Namespace,
    reference: dict[str, Any] | None = None,
) -> dict[str, Any]:
    spec = SyntheticSpec(train_batches=args.train_batches)
    data = SyntheticClickLogs(spec)
    root = tempfile.mkdtemp(prefix="reliability-")
    recovering = kind in RECOVER_KINDS or kind.startswith("none_")
    config = ps.TrainConfig(
        servers=2, trainers=3, progress=False, heartbeat_interval=0.5,
        trainer_timeout=TRAINER_TIMEOUT, checkpoint_dir=root,
        checkpoint_every=50 if kind == "server_kill" or recovering else None,
        max_restarts=1 if kind == "server_kill" or recovering else 0, stall_timeout=STALL_TIMEOUT,
    )  # fmt: skip
    if recovering:  # none_sync, none_async: the uninterrupted runs the recover trials match
        mode = kind.rpartition("_")[2]
        config = config.replace(
            mode=mode, publish_dir=os.path.join(root, "log"), recover=kind in RECOVER_KINDS
        )
    chief_steps = [0]
    stepped_at = [0.0]  # when the chief's steps last rose
    outcome: dict[str, Any] = {}

    def progress(p: Progress) -> None:
        if p.trainer == 0:
            if p.steps > chief_steps[0]:
                stepped_at[0] = time.monotonic()
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
    trial: dict[str, Any] = {"kind": kind, "root": root}
    if kind != "stuck" and not kind.startswith("none"):
        at = rng.uniform(0.2, 0.7) * steps_per_trainer
        while chief_steps[0] < at and thread.is_alive():
            time.sleep(0.01)
        if kind == "server_kill":
            while load_latest(root) is None and thread.is_alive():
                time.sleep(0.01)
        rank = (
            1 if kind == "server_kill" or kind in RECOVER_KINDS else 2 + 1
        )  # server 1 or trainer 1
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
        if kind in RECOVER_KINDS:
            while thread.is_alive() and stepped_at[0] <= killed:
                time.sleep(0.01)
            trial["paused_s"] = stepped_at[0] - killed if stepped_at[0] > killed else None
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
    if kind in RECOVER_KINDS:
        trial["server_restarts"] = summary["server_restarts"]
        trial["restore_s"] = [r["restore_s"] for r in summary["recovery"]["servers"] if r]
        trial["resent_calls"] = summary["recovery"]["resent_calls"]
        recover_compared(trial, root, reference)
    trial["samples_per_s"] = summary["samples_per_s"]
    if not kind.startswith("none_"):  # an uninterrupted run's is read by the caller
        shutil.rmtree(root, ignore_errors=True)
    return trial


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--train-batches", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="reliability.json")
    parser.add_argument(
        "--kinds", nargs="+", default=["trainer_kill", "freeze", "server_kill", "stuck"],
        choices=["trainer_kill", "freeze", "server_kill", "stuck", *RECOVER_KINDS],
    )  # fmt: skip
    args = parser.parse_args()
    rng = random.Random(args.seed)
    baseline = run_trial("none", rng, args)
    references = {}  # each recover kind's uninterrupted final checkpoint
    for kind in (k for k in args.kinds if k in RECOVER_KINDS):
        mode = kind.rpartition("_")[2]
        root = run_trial(f"none_{mode}", rng, args)["root"]
        references[kind] = final_tensors(root)
        shutil.rmtree(root, ignore_errors=True)
    classes: dict[str, Any] = {}
    for kind in args.kinds:
        trials = [run_trial(kind, rng, args, references.get(kind)) for _ in range(args.trials)]
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
        if kind in RECOVER_KINDS:
            paused = [t["paused_s"] for t in trials if t.get("paused_s") is not None]
            restore = [s for t in trials for s in t.get("restore_s", [])]
            classes[kind].update(
                updates_lost_max=max((t.get("updates_lost", -1) for t in done), default=None),
                update_counts_equal=sum(bool(t.get("update_counts_equal")) for t in done),
                bitwise_equal=sum(bool(t.get("bitwise_equal")) for t in done),
                paused_s_median=statistics.median(paused) if paused else None,
                paused_s_max=max(paused, default=None),
                restore_s_max=max(restore, default=None),
            )
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
