"""paramserver's command line: each command run (``train``, ``serve``, ``export``, ``check``,
``report``) from the flags :mod:`paramserver.cliargs` parses, which says what they are."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paramserver.api import train, under_torchrun
from paramserver.baseline import train_single_process
from paramserver.checkpoint import Checkpoint, load_latest, open_checkpoint
from paramserver.checkpoint.export import export_checkpoint
from paramserver.checkpoint.manifest import MANIFEST
from paramserver.checkpoint.store import LATEST, checkpoint_dir, verify
from paramserver.cliargs import (
    build_parser,
    refuse_numeric_lr_decay_flag,
    refuse_renamed_flags,
    refuse_switch_values,
)
from paramserver.config import TrainConfig, read_toml
from paramserver.errors import CheckpointError, ConfigError, ParamServerError
from paramserver.files import write_atomic
from paramserver.jobs import DATASET_DEFAULTS, build_job, served_job
from paramserver.observe.report import write_report
from paramserver.observe.runlog import write_summary
from paramserver.observe.summary import nothing_trained, what_happened
from paramserver.progress import ProgressDisplay

if TYPE_CHECKING:
    from torch import Tensor, nn

log = logging.getLogger("paramserver")


def find_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint at ``path`` (a checkpoint directory), or the newest valid one under it
    (a job's ``--checkpoint-dir``)."""
    if (path / "manifest.json").exists():
        return open_checkpoint(path)
    found = load_latest(path)
    if found is None:
        raise CheckpointError(f"{path}: no checkpoint here")
    return found


def run_export(args: argparse.Namespace) -> int:
    found = find_checkpoint(args.checkpoint)
    written = export_checkpoint(found, args.out)
    which = (
        "the job's final model" if found.meta.get("final")
        else "saved during the job, which may have trained past it"
    )  # fmt: skip
    print(f"wrote the model at step {found.step} ({which}): {written} tensors of "
          f"{found.directory} to {args.out}")  # fmt: skip
    return 0


CHECK_OK, CHECK_NONE_LOADS, CHECK_OLDER_LOADS = 0, 1, 3
"""``paramserver check`` exit statuses: the newest checkpoint verifies (and is the one a resume
loads); none verifies (or the checkpoint directory given is damaged); the newest is damaged or
unfinished and a resume would load an older one. 2 is a usage error, as for every command."""


def run_check(args: argparse.Namespace) -> int:
    """Verify a checkpoint directory, or every checkpoint under a job's root newer than the one
    a resume would load; say which that is and whether it is the newest (see ``CHECK_*``)."""
    path: Path = args.checkpoint
    if (path / MANIFEST).exists():
        given = open_checkpoint(path)  # CheckpointError naming each problem: status 1
        print(f"{given.directory}: ok (step {given.step}, {len(given.part_names)} parts)")
        return CHECK_OK
    # load_latest warns of each checkpoint it skips; here each is reported below instead.
    store_log = logging.getLogger(load_latest.__module__)
    level = store_log.level
    store_log.setLevel(logging.ERROR)
    try:
        found = load_latest(path)  # CheckpointError if none verifies: status 1
    finally:
        store_log.setLevel(level)
    if found is None:
        raise CheckpointError(f"{path}: no checkpoint here")
    later = [(d, (d / MANIFEST).exists()) for step, d in checkpoint_dirs(path) if step > found.step]
    for directory, committed in later:
        if not committed:
            print(f"{directory}: not committed (no {MANIFEST}: interrupted, or being written)")
        elif problems := verify(directory):
            print(f"{directory}: DAMAGED: {'; '.join(problems)}")
        else:
            print(f"{directory}: intact, but {LATEST} does not name it (its commit did not end)")
    print(f"{found.directory}: ok (step {found.step}, {len(found.part_names)} parts)")
    newer = [directory for directory, committed in later if committed]
    if newer:
        print(
            f"the newest checkpoint, {newer[-1].name}, cannot be loaded: a resume loads "
            f"{found.directory.name} (step {found.step})"
        )
        return CHECK_OLDER_LOADS
    print(f"a resume loads {found.directory.name}, the newest checkpoint")
    return CHECK_OK


def checkpoint_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every checkpoint directory under ``root``, oldest first."""
    found = []
    for entry in root.glob("ckpt-*"):
        step = entry.name.removeprefix("ckpt-")
        if step.isdigit() and checkpoint_dir(root, int(step)) == entry and entry.is_dir():
            found.append((int(step), entry))
    return sorted(found)


def run_report(args: argparse.Namespace) -> int:
    for path in write_report(args.run_dir, args.out):
        print(f"wrote {path}")
    return 0


def config_from_args(
    args: argparse.Namespace, defaults: dict[str, Any] | None = None
) -> TrainConfig:
    """TrainConfig from ``defaults`` (a dataset's own), then the TOML file, then the flags."""
    values: dict[str, Any] = dict(defaults or {})
    values.update(read_toml(args.config) if args.config else {})
    values.update(
        {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    )
    return TrainConfig(**values)


def single_process_summary(args: argparse.Namespace, config: TrainConfig) -> dict[str, Any]:
    """``--compare-single-process``: the same model trained on the same data, batches in the
    order a sync job would see them, in one process (:mod:`paramserver.baseline`), then
    evaluated the same way: throughput and the job's held-out metrics."""
    job = build_job(args, config)
    log.info("training the single-process reference")
    model, stats = train_single_process(job.model_fn, job.data_fn, job.loss_fn, config)
    summary: dict[str, Any] = {
        "samples_per_s": stats["samples_per_s"],
        "samples": stats["samples"],
        "seconds": stats["seconds"],
    }
    summary.update(job.evaluate(model))
    return summary


def run_train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    config = config_from_args(args, DATASET_DEFAULTS.get(args.dataset.partition(":")[0]))
    if config.publish_dir is not None:  # for `paramserver serve` to rebuild the job's model
        record_job(Path(config.publish_dir), list(argv[argv.index("train") + 1 :]))
    if under_torchrun():  # every rank runs this: its log lines name its role
        rank = int(os.environ["RANK"])
        role = f"server{rank}" if rank < config.servers else f"trainer{rank - config.servers}"
        log_as(role, force=True)
    job = build_job(args, config)
    if config.evaluates_while_training and job.evaluation is None:
        raise ConfigError(
            "--eval-every(-s) needs held-out data (for criteo:PATH, --eval-data or "
            "--eval-fraction; for a stream, --eval-data)"
        )
    # The job's own display knows how many steps to expect; train()'s would not.
    display = (
        ProgressDisplay(job.total_steps, log_every_s=config.log_every) if config.progress else None
    )
    log.info(
        "training: %d servers, %d trainers, mode %s, %s lr %g",
        config.servers,
        config.trainers,
        config.mode,
        config.optimizer,
        config.lr,
    )
    try:
        result = train(
            job.model_fn,
            job.data_fn,
            job.loss_fn,
            config.replace(batch_size=None),  # spent on the job's data, which train() takes
            on_progress=display,
            evaluation=job.evaluation,
        )
    finally:
        if display is not None:
            display.close()
    if result is None:  # a torchrun rank other than the chief
        return 0
    if result.model is not None:  # train() evaluated it: add what to judge the figures by
        result.summary.update(job.make_references())
    if args.compare_single_process:
        result.summary["single_process"] = single_process_summary(args, config)
    print_summary(result.summary)
    if args.summary_json:
        args.summary_json.write_text(json.dumps(result.summary, indent=2) + "\n")
    if config.run_dir is not None:  # again, with the held-out metrics
        write_summary(config.run_dir, result.summary)
    return 0


JOB_RECORD = "job.json"


def record_job(publish_dir: Path, argv: list[str]) -> None:
    """Write the train command and the directory it ran in into ``publish_dir``
    (``job.json``), so that ``paramserver serve --follow`` rebuilds the job's model as the job
    built it, its relative paths meaning what they meant to the job."""
    publish_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"train_argv": argv, "cwd": os.getcwd()}, indent=2).encode()
    write_atomic(publish_dir / JOB_RECORD, lambda f: f.write(text), hash_written=False)


@dataclass
class RecordedJob:
    """What serving rebuilds of a recorded job: its config, model and two samples of its
    inputs (see :func:`paramserver.jobs.served_job`)."""

    config: TrainConfig
    model_fn: Callable[[], nn.Module]
    example: list[Tensor]
    checkpoint_dir: Path | None = None  # the job's --checkpoint-dir, where the job ran


def recorded_job(path: Path) -> RecordedJob:
    """The job whose train command ``path`` records, parsed as ``paramserver train`` parses
    it, in the directory it ran in (its relative paths mean what they meant to the job)."""
    try:
        record = json.loads(path.read_text())
        argv, cwd = record["train_argv"], record["cwd"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(
            f"{path}: not a job record `paramserver train --publish-dir` writes ({error}); "
            f"give the train command's record with --job"
        ) from None
    if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
        raise ConfigError(f"{path}: train_argv must be a list of strings")
    if not isinstance(cwd, str):
        raise ConfigError(f"{path}: cwd must be a string")
    here = os.getcwd()
    try:
        os.chdir(cwd)
    except OSError as error:
        raise ConfigError(f"{path}: the job ran in {cwd}, which is not here: {error}") from None
    try:
        args = build_parser().parse_args(["train", *argv])
        config = config_from_args(args, DATASET_DEFAULTS.get(args.dataset.partition(":")[0]))
        checkpoints = None if config.checkpoint_dir is None else Path(cwd, config.checkpoint_dir)
        return RecordedJob(config, *served_job(args, config), checkpoints)
    except ConfigError as error:
        raise ConfigError(f"{path}: the recorded job (run in {cwd}): {error}") from None
    finally:
        os.chdir(here)


def run_serve(args: argparse.Namespace) -> int:
    """Serve the recorded job's model until SIGTERM or Ctrl-C (see ``paramserver serve -h``)."""
    from paramserver.serving.run import serve  # not on `paramserver train`'s way to its start

    record = args.job or (args.follow / JOB_RECORD if args.follow else None)
    if record is None:
        raise ConfigError("paramserver serve needs --follow DIR (a job's --publish-dir) or --job")
    job = recorded_job(record)
    serving = serve(
        job.model_fn, follow=args.follow, base=args.base, example_inputs=job.example,
        seed=job.config.seed, model_name=args.model_name, host=args.host,
        http_port=args.http_port, grpc_port=args.grpc_port, poll_s=args.poll_every,
        mmap_dir=args.mmap_dir, http_timeout_s=args.http_timeout,
        http_max_connections=args.http_max_connections, checkpoint_dir=job.checkpoint_dir,
    )  # fmt: skip
    print(
        f"serving {args.model_name!r} and {len(serving.served.plan.tables)} tables on "
        f"http://{args.host}:{serving.http_port} and grpc {args.host}:{serving.grpc_port}",
        flush=True,
    )
    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    try:
        while not stopped.wait(1.0):
            pass
    finally:
        serving.close()
    return 0


# Held-out metrics as printed: summary key, name, and the reference figure shown beside it.
HELD_OUT_LINES = (
    ("eval_auc", "AUC", "eval_auc_ceiling", "ground truth's own"),
    ("eval_logloss", "loss", None, None),
    ("eval_rmse", "RMSE", "eval_rmse_mean_predictor", "global-mean predictor"),
    ("eval_mae", "MAE", None, None),
)


def print_summary(summary: dict[str, Any]) -> None:
    """The summary as the command prints it: the figures, then what happened (restarts,
    recovery, departures, a stream's records: :func:`what_happened`); one line saying so
    where the run trained nothing."""
    nothing = nothing_trained(summary)
    if nothing is not None:
        print(nothing)
        return
    traffic = summary["bytes"]
    attempts = len(summary.get("attempts") or []) or 1
    shape = f"{summary['trainers']} trainers, {summary['servers']} servers, {summary['mode']}"
    lines = [
        f"steps          {summary['steps']} ({shape}"
        + (f"; {attempts} attempts)" if attempts > 1 else ")"),
        f"samples        {summary['samples']:,}  ({summary['samples_per_s']:,.0f} samples/s)",
        f"train loss     {summary['train_loss']:.4f}"
        + (" (the finished attempt's steps)" if attempts > 1 else ""),
    ]
    for key, name, reference, described in HELD_OUT_LINES:
        if key in summary:
            known = f"  ({described}: {summary[reference]:.4f})" if reference in summary else ""
            lines.append(f"{'held-out ' + name:<15}{summary[key]:.4f}{known}")
    single = summary.get("single_process")
    if single is not None:
        figures = [f"{name} {single[key]:.4f}" for key, name, *_ in HELD_OUT_LINES if key in single]
        held_out = f"; held-out {', '.join(figures)}" if figures else ""
        lines.append(f"single process {single['samples_per_s']:,.0f} samples/s{held_out}")
    lines.append(
        f"trainer bytes  sent {traffic['trainers']['sent'] / 1e6:,.1f} MB, received "
        f"{traffic['trainers']['received'] / 1e6:,.1f} MB"
    )
    for op in ("push_pull", "push_pulls"):
        calls = summary.get("calls", {}).get(op)
        if calls:
            lines.append(
                f"{op:<15}{calls['calls']:,} calls, latency p50 {calls['p50_ms']:.1f} ms, "
                f"p99 {calls['p99_ms']:.1f} ms"
            )
    lines += [f"{label:<15}{text}" for label, text in what_happened(summary)]
    lines.append(f"wall time      {summary['wall_s']:.1f} s")
    print("\n".join(lines))


def log_as(role: str, force: bool = False) -> None:
    """Log lines that name the process's role; ``force`` replaces an earlier set-up."""
    logging.basicConfig(
        level=logging.INFO,
        format=f"[{role}] %(asctime)s %(message)s",
        datefmt="%H:%M:%S",
        force=force,
    )


def main(argv: list[str] | None = None) -> int:
    log_as("launcher")
    argv = sys.argv[1:] if argv is None else argv
    try:
        refuse_switch_values(argv)
        refuse_renamed_flags(argv)
        refuse_numeric_lr_decay_flag(argv)
        args = build_parser().parse_args(argv)
        if args.command == "train":
            return run_train(args, argv)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "export":
            return run_export(args)
        if args.command == "check":
            return run_check(args)
        if args.command == "report":
            return run_report(args)
    except ParamServerError as error:
        print(f"paramserver: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, ValueError) else 1
    except KeyboardInterrupt:
        print("paramserver: interrupted; every job process was stopped", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
