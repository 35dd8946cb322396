"""TrainConfig's validation, run once when a config is made: a function per concern, each error
naming the flag to change (``--ssp-bound``), since flags, TOML keys and fields share names.

Values from a TOML file arrive untyped, so types are checked first, from the fields'
annotations (a ``Literal`` choice takes its values' type; its value is checked against the
choices with the rest of its concern). Many rules join two sections (``--cache-rows`` needs
``--mode`` async or ssp), so they read the whole config.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin, get_type_hints

from paramserver.config.choices import (
    DENSE_SYNCS,
    GRADIENT_CODECS,
    LAUNCHERS,
    MODES,
    PUBLISH_CODECS,
    VALUE_CODECS,
    type_parts,
)
from paramserver.config.sections import CALLS_PER_MESSAGE
from paramserver.errors import ConfigError
from paramserver.optimconfig import OPTIMIZERS

if TYPE_CHECKING:
    from paramserver.config.train import TrainConfig

_SIMPLE_TYPES: dict[Any, tuple[type, ...]] = {
    int: (int,),
    float: (int, float),
    str: (str,),
    bool: (bool,),
    type(None): (type(None),),
}


def flag(field_name: str) -> str:
    """The flag of a field, without its dashes: ``rpc_threads`` is ``rpc-threads``."""
    return field_name.replace("_", "-")


def check(config: TrainConfig) -> None:
    """Every check, in order: a later one may count on what an earlier one checked."""
    check_types(config)
    _check_counts(config)
    _check_consistency(config)
    _check_codecs(config)
    _check_checkpoints(config)
    _check_training(config)
    _check_observing(config)
    _check_publishing(config)
    _check_schedules(config)


def _check_publishing(config: TrainConfig) -> None:
    """The change log."""
    if not config.publish_every > 0:
        raise ConfigError(f"--publish-every must be > 0 seconds, got {config.publish_every}")
    if config.publish_keep < 1:
        raise ConfigError(f"--publish-keep must be >= 1, got {config.publish_keep}")
    if config.publish_dir is not None and config.dense_sync == "allreduce":
        raise ConfigError(
            "--publish-dir publishes what the servers hold; with --dense-sync allreduce the "
            "trainers hold the dense parameters, which serving would then never see"
        )
    if config.recover:
        if config.publish_dir is None:
            raise ConfigError(
                "--recover keeps what a lost server needs in its change log: "
                "give the log a place with --publish-dir"
            )
        if config.mode == "ssp":
            raise ConfigError(
                "--recover works in sync and async modes; an SSP server holds answers back "
                "past the cuts of its log, so a recovered one could not read them as it would "
                "have"
            )
        if config.launcher == "threads":
            raise ConfigError(
                "--recover restarts a server's process: use --launcher processes or torchrun"
            )
    if not config.recover_wait > 0:
        raise ConfigError(f"--recover-wait must be > 0 seconds, got {config.recover_wait}")


_SimpleTypes = dict[str, tuple[tuple[type, ...], str]]
_simple_types: dict[type, _SimpleTypes] = {}  # by class: its fields' types are resolved once


def simple_types(cls: type) -> _SimpleTypes:
    """Each field of ``cls`` whose type is simple (numbers, strings, booleans, choices, None):
    the types its value may have, and how to name them. Structured fields are left out."""
    if cls in _simple_types:
        return _simple_types[cls]
    hints = get_type_hints(cls)
    found: _SimpleTypes = {}
    for f in dataclasses.fields(cls):
        kinds = [_kind(part) for part in type_parts(hints[f.name])]
        if all(kind in _SIMPLE_TYPES for kind in kinds):
            allowed = tuple(t for kind in kinds for t in _SIMPLE_TYPES[kind])
            found[f.name] = allowed, " | ".join(_type_name(kind) for kind in kinds)
    _simple_types[cls] = found  # whole: another thread may read it at once
    return found


def _kind(part: Any) -> Any:
    """A ``Literal``'s values' type (a field's choices are all strings), else ``part``."""
    return type(get_args(part)[0]) if get_origin(part) is Literal else part


def _type_name(kind: Any) -> str:
    return "None" if kind is type(None) else str(kind.__name__)


def check_types(config: TrainConfig) -> None:
    """Values from a TOML file arrive untyped: name the field whose value has the wrong type."""
    for name, (allowed, named) in simple_types(type(config)).items():
        value = getattr(config, name)
        if isinstance(value, bool) and bool not in allowed:
            allowed = ()
        if not isinstance(value, allowed):
            raise ConfigError(
                f"--{flag(name)} must be of type {named}, got {type(value).__name__} {value!r}"
            )


def _check_counts(config: TrainConfig) -> None:
    """Sizes and counts: the job's shape and its data."""
    positive = (
        "servers",
        "trainers",
        "epochs",
        "accumulate",
        "min_contributors",
        "rpc_threads",
        "threads_per_process",
        "metrics_every",
    )
    for name in positive:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"--{flag(name)} must be an integer >= 1, got {value!r}")
    if config.steps is not None and config.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {config.steps}")
    if config.batch_size is not None and config.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {config.batch_size}")
    if not config.log_every > 0:
        raise ConfigError(f"--log-every must be > 0 seconds, got {config.log_every}")


def _check_choices(config: TrainConfig) -> None:
    """The mode, the launcher and where dense parameters are kept are among their choices."""
    if config.mode not in MODES:
        raise ConfigError(f"--mode: unknown mode {config.mode!r}; choose from {MODES}")
    if config.launcher not in LAUNCHERS:
        raise ConfigError(
            f"--launcher: unknown launcher {config.launcher!r}; choose from {LAUNCHERS}"
        )
    if config.dense_sync not in DENSE_SYNCS:
        raise ConfigError(
            f"--dense-sync: unknown value {config.dense_sync!r}; choose from {DENSE_SYNCS}"
        )


def _check_consistency(config: TrainConfig) -> None:
    """Mode, launcher, rounds, and the limits of liveness."""
    _check_choices(config)
    if not isinstance(config.ssp_bound, int) or config.ssp_bound < 0:
        raise ConfigError(f"--ssp-bound must be an integer >= 0, got {config.ssp_bound!r}")
    _check_steps_per_call(config)
    if config.round_deadline is not None and not config.round_deadline > 0:
        raise ConfigError(f"--round-deadline must be > 0 seconds, got {config.round_deadline}")
    if config.min_contributors > config.trainers:
        raise ConfigError(
            f"--min-contributors {config.min_contributors} exceeds --trainers {config.trainers}"
        )
    if not config.heartbeat_interval > 0:
        raise ConfigError(
            f"--heartbeat-interval must be > 0 seconds, got {config.heartbeat_interval}"
        )
    if not config.trainer_timeout >= 2 * config.heartbeat_interval:
        raise ConfigError(
            f"--trainer-timeout ({config.trainer_timeout} s) must be at least twice "
            f"--heartbeat-interval ({config.heartbeat_interval} s)"
        )
    if config.stall_timeout is not None and not config.stall_timeout >= config.trainer_timeout:
        raise ConfigError(
            f"--stall-timeout ({config.stall_timeout} s) must be at least --trainer-timeout "
            f"({config.trainer_timeout} s)"
        )


def _check_steps_per_call(config: TrainConfig) -> None:
    k = config.steps_per_call
    if not isinstance(k, int) or not 1 <= k <= CALLS_PER_MESSAGE:
        raise ConfigError(
            f"--steps-per-call must be an integer from 1 to {CALLS_PER_MESSAGE}, got {k!r}"
        )
    if k == 1:
        return
    if config.mode == "sync":
        raise ConfigError(
            "--steps-per-call > 1 needs --mode async or ssp: sync applies every trainer's "
            "step before the next, so each step needs a pull of its own"
        )
    if config.mode == "ssp" and config.ssp_bound < k - 1:
        raise ConfigError(
            f"--steps-per-call {k} computes {k - 1} steps past each pull: it needs "
            f"--ssp-bound >= {k - 1}, got {config.ssp_bound}"
        )
    if config.server_pooling:
        raise ConfigError(
            "--steps-per-call > 1 does not work with --server-pooling (the servers pool "
            "one step's bags per pull)"
        )
    if config.dense_sync == "allreduce":
        raise ConfigError(
            "--steps-per-call > 1 does not work with --dense-sync allreduce (its "
            "all-reduce goes with each call)"
        )


def _check_codecs(config: TrainConfig) -> None:
    """Codecs on the wire and in the change log, and the trainers' row cache."""
    for name, codecs in (
        ("dense_push_codec", GRADIENT_CODECS),
        ("dense_pull_codec", VALUE_CODECS),
        ("table_push_codec", VALUE_CODECS),
        ("table_pull_codec", VALUE_CODECS),
        ("publish_codec", PUBLISH_CODECS),
    ):
        if getattr(config, name) not in codecs:
            raise ConfigError(
                f"--{flag(name)}: unknown codec {getattr(config, name)!r}; choose from {codecs}"
            )
    dense_codecs = (config.dense_push_codec, config.dense_pull_codec)
    if config.dense_sync == "allreduce" and dense_codecs != ("none", "none"):
        raise ConfigError(
            "--dense-push-codec and --dense-pull-codec code dense traffic with servers: "
            "with --dense-sync allreduce dense parameters never travel to them"
        )
    if not 0 < config.topk_ratio <= 1:
        raise ConfigError(f"--topk-ratio must be in (0, 1], got {config.topk_ratio}")
    for name in ("cache_rows", "cache_lag", "max_restarts"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"--{flag(name)} must be an integer >= 0, got {value!r}")
    if config.cache_rows and config.mode == "sync":
        raise ConfigError(
            "--cache-rows needs --mode async or ssp: sync rounds promise current values"
        )


def _check_checkpoints(config: TrainConfig) -> None:
    """Checkpoints, restarts, and the RPC limits."""
    if (config.checkpoint_every or config.checkpoint_every_s or config.resume) and (
        config.checkpoint_dir is None
    ):
        raise ConfigError("--checkpoint-every(-s) and --resume need --checkpoint-dir")
    if config.checkpoint_every is not None and config.checkpoint_every < 1:
        raise ConfigError(f"--checkpoint-every must be >= 1, got {config.checkpoint_every}")
    if config.checkpoint_every_s is not None and not config.checkpoint_every_s > 0:
        raise ConfigError(f"--checkpoint-every-s must be > 0, got {config.checkpoint_every_s}")
    if config.checkpoint_keep < 2:
        raise ConfigError(f"--checkpoint-keep must be >= 2, got {config.checkpoint_keep}")
    if not config.max_message_mb > 0:
        raise ConfigError(f"--max-message-mb must be > 0, got {config.max_message_mb}")
    if config.rpc_timeout <= 0:
        raise ConfigError(f"--rpc-timeout must be > 0 seconds, got {config.rpc_timeout}")


def _check_training(config: TrainConfig) -> None:
    """Update rules, clipping and server-side pooling."""
    if config.clip_grad_norm is not None and config.clip_grad_norm <= 0:
        raise ConfigError(f"--clip-grad-norm must be > 0, got {config.clip_grad_norm}")
    if config.optimizer == "rowwise_adagrad":
        raise ConfigError(
            "--optimizer: rowwise_adagrad applies to embedding tables only; "
            "use --table-optimizer rowwise_adagrad"
        )
    if config.server_pooling and (config.accumulate > 1 or config.clip_grad_norm is not None):
        raise ConfigError(
            "--server-pooling works with --accumulate 1 and without --clip-grad-norm "
            "(the trainer never sees those tables' row gradients)"
        )


def _check_observing(config: TrainConfig) -> None:
    """Evaluation, consistency checks and profiling."""
    for name in ("eval_every", "consistency_every"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag(name)} must be >= 1, got {value}")
    if config.eval_every_s is not None and not config.eval_every_s > 0:
        raise ConfigError(f"--eval-every-s must be > 0, got {config.eval_every_s}")
    if config.profile_steps < 0 or config.profile_start < 0:
        raise ConfigError("--profile-steps and --profile-start must be >= 0")
    if config.profile_steps and config.run_dir is None:
        raise ConfigError("--profile-steps needs --run-dir (the trace is written there)")
    if config.evaluates_while_training and config.server_pooling:
        raise ConfigError(
            "--eval-every(-s) does not work with --server-pooling tables (evaluation reads "
            "rows, and those tables' trainers never hold rows)"
        )


def _check_schedules(config: TrainConfig) -> None:
    """Every group's update rule and schedule (building a rule checks its values with
    flag-named errors), and each group's factor at step 0: a bad ``lr_schedule`` is refused
    before the job starts."""
    builtin = config.builtin_schedule_given()
    if config.lr_schedule is not None and builtin:
        raise ConfigError(
            f"lr_schedule and {', '.join(sorted(builtin))} both set a schedule: give one"
        )
    config.dense_optimizer().lr_factor(0, "dense")
    if config.table_optimizer is not None and config.table_optimizer not in OPTIMIZERS:
        raise ConfigError(
            f"--table-optimizer: unknown optimizer {config.table_optimizer!r}; choose from "
            f"{OPTIMIZERS}, as for --optimizer"
        )
    config.table_optimizer_for("").lr_factor(0, "tables")
    for table in config.table_optimizers:
        try:
            rule = config.table_optimizer_for(table)
        except ConfigError as error:
            raise ConfigError(f"table {table!r} ([tables.{table}]): {error}") from None
        rule.lr_factor(0, table)
