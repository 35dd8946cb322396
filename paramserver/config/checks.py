"""TrainConfig's validation, run once when a config is made: a function per concern, each error
naming the flag to change (``--ssp-bound``), since flags, TOML keys and fields share names.

Values from a TOML file arrive untyped, so types are checked first, from the fields'
annotations (a ``Literal`` choice takes its values' type; its value is checked against the
choices with the rest of its concern). Many rules join two sections (``--cache-rows`` needs
``--mode`` async or ssp): :func:`check` takes a TrainConfig's :class:`Sections` and hands
each concern the sections it reads, never the TrainConfig itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args, get_origin, get_type_hints

from paramserver.config.choices import (
    DENSE_SYNCS,
    GRADIENT_CODECS,
    LAUNCHERS,
    MODES,
    PUBLISH_CODECS,
    VALUE_CODECS,
    type_parts,
)
from paramserver.config.rules import CodecsSection, OptimSection
from paramserver.config.sections import (
    CALLS_PER_MESSAGE,
    CheckpointSection,
    ConsistencySection,
    LaunchSection,
    LoopSection,
    ObserveSection,
    PublishSection,
    TablesSection,
)
from paramserver.config.views import Sections
from paramserver.errors import ConfigError
from paramserver.optimconfig import OPTIMIZERS

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


def check(s: Sections) -> None:
    """Every check, in order: a later one may count on what an earlier one checked."""
    check_types(s)
    _check_counts(s)
    _check_consistency(s.consistency, s.launch, s.tables)
    _check_codecs(s.codecs, s.consistency, s.tables, s.launch, s.publish)
    _check_checkpoints(s.checkpoint, s.launch)
    _check_training(s.loop, s.optim, s.tables)
    _check_observing(s.observe, s.tables)
    _check_publishing(s.publish, s.consistency, s.launch)
    _check_schedules(s.optim)


def _check_publishing(
    publish: PublishSection, consistency: ConsistencySection, launch: LaunchSection
) -> None:
    """The change log."""
    if not publish.publish_every > 0:
        raise ConfigError(f"--publish-every must be > 0 seconds, got {publish.publish_every}")
    if publish.publish_keep < 1:
        raise ConfigError(f"--publish-keep must be >= 1, got {publish.publish_keep}")
    if publish.publish_dir is not None and consistency.dense_sync == "allreduce":
        raise ConfigError(
            "--publish-dir publishes what the servers hold; with --dense-sync allreduce the "
            "trainers hold the dense parameters, which serving would then never see"
        )
    if publish.recover:
        if publish.publish_dir is None:
            raise ConfigError(
                "--recover keeps what a lost server needs in its change log: "
                "give the log a place with --publish-dir"
            )
        if consistency.mode == "ssp":
            raise ConfigError(
                "--recover works in sync and async modes; an SSP server holds answers back "
                "past the cuts of its log, so a recovered one could not read them as it would "
                "have"
            )
        if launch.launcher == "threads":
            raise ConfigError(
                "--recover restarts a server's process: use --launcher processes or torchrun"
            )
    if not publish.recover_wait > 0:
        raise ConfigError(f"--recover-wait must be > 0 seconds, got {publish.recover_wait}")


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


def check_types(s: Sections) -> None:
    """Values from a TOML file arrive untyped: name the field whose value has the wrong type."""
    for section in (getattr(s, f.name) for f in dataclasses.fields(s)):
        _check_section_types(section)


def _check_section_types(section: Any) -> None:
    for name, (allowed, named) in simple_types(type(section)).items():
        value = getattr(section, name)
        if isinstance(value, bool) and bool not in allowed:
            allowed = ()
        if not isinstance(value, allowed):
            raise ConfigError(
                f"--{flag(name)} must be of type {named}, got {type(value).__name__} {value!r}"
            )


def _check_counts(s: Sections) -> None:
    """Sizes and counts: the job's shape and its data."""
    positive = (
        (s.launch, "servers"),
        (s.launch, "trainers"),
        (s.loop, "epochs"),
        (s.loop, "accumulate"),
        (s.consistency, "min_contributors"),
        (s.launch, "rpc_threads"),
        (s.launch, "threads_per_process"),
        (s.observe, "metrics_every"),
    )
    for section, name in positive:
        value = getattr(section, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"--{flag(name)} must be an integer >= 1, got {value!r}")
    if s.loop.steps is not None and s.loop.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {s.loop.steps}")
    if s.loop.batch_size is not None and s.loop.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {s.loop.batch_size}")
    if not s.observe.log_every > 0:
        raise ConfigError(f"--log-every must be > 0 seconds, got {s.observe.log_every}")


def _check_choices(consistency: ConsistencySection, launch: LaunchSection) -> None:
    """The mode, the launcher and where dense parameters are kept are among their choices."""
    if consistency.mode not in MODES:
        raise ConfigError(f"--mode: unknown mode {consistency.mode!r}; choose from {MODES}")
    if launch.launcher not in LAUNCHERS:
        raise ConfigError(
            f"--launcher: unknown launcher {launch.launcher!r}; choose from {LAUNCHERS}"
        )
    if consistency.dense_sync not in DENSE_SYNCS:
        raise ConfigError(
            f"--dense-sync: unknown value {consistency.dense_sync!r}; choose from {DENSE_SYNCS}"
        )


def _check_consistency(
    consistency: ConsistencySection, launch: LaunchSection, tables: TablesSection
) -> None:
    """Mode, launcher, rounds, and the limits of liveness."""
    _check_choices(consistency, launch)
    if not isinstance(consistency.ssp_bound, int) or consistency.ssp_bound < 0:
        raise ConfigError(f"--ssp-bound must be an integer >= 0, got {consistency.ssp_bound!r}")
    _check_steps_per_call(consistency, tables)
    if consistency.round_deadline is not None and not consistency.round_deadline > 0:
        raise ConfigError(f"--round-deadline must be > 0 seconds, got {consistency.round_deadline}")
    if consistency.min_contributors > launch.trainers:
        raise ConfigError(
            f"--min-contributors {consistency.min_contributors} exceeds --trainers "
            f"{launch.trainers}"
        )
    if not consistency.heartbeat_interval > 0:
        raise ConfigError(
            f"--heartbeat-interval must be > 0 seconds, got {consistency.heartbeat_interval}"
        )
    if not consistency.trainer_timeout >= 2 * consistency.heartbeat_interval:
        raise ConfigError(
            f"--trainer-timeout ({consistency.trainer_timeout} s) must be at least twice "
            f"--heartbeat-interval ({consistency.heartbeat_interval} s)"
        )
    stall = consistency.stall_timeout
    if stall is not None and not stall >= consistency.trainer_timeout:
        raise ConfigError(
            f"--stall-timeout ({stall} s) must be at least --trainer-timeout "
            f"({consistency.trainer_timeout} s)"
        )


def _check_steps_per_call(consistency: ConsistencySection, tables: TablesSection) -> None:
    k = consistency.steps_per_call
    if not isinstance(k, int) or not 1 <= k <= CALLS_PER_MESSAGE:
        raise ConfigError(
            f"--steps-per-call must be an integer from 1 to {CALLS_PER_MESSAGE}, got {k!r}"
        )
    if k == 1:
        return
    if consistency.mode == "sync":
        raise ConfigError(
            "--steps-per-call > 1 needs --mode async or ssp: sync applies every trainer's "
            "step before the next, so each step needs a pull of its own"
        )
    if consistency.mode == "ssp" and consistency.ssp_bound < k - 1:
        raise ConfigError(
            f"--steps-per-call {k} computes {k - 1} steps past each pull: it needs "
            f"--ssp-bound >= {k - 1}, got {consistency.ssp_bound}"
        )
    if tables.server_pooling:
        raise ConfigError(
            "--steps-per-call > 1 does not work with --server-pooling (the servers pool "
            "one step's bags per pull)"
        )
    if consistency.dense_sync == "allreduce":
        raise ConfigError(
            "--steps-per-call > 1 does not work with --dense-sync allreduce (its "
            "all-reduce goes with each call)"
        )


def _check_codecs(
    codecs: CodecsSection,
    consistency: ConsistencySection,
    tables: TablesSection,
    launch: LaunchSection,
    publish: PublishSection,
) -> None:
    """Codecs on the wire and in the change log, and the trainers' row cache."""
    for section, name, choices in (
        (codecs, "dense_push_codec", GRADIENT_CODECS),
        (codecs, "dense_pull_codec", VALUE_CODECS),
        (codecs, "table_push_codec", VALUE_CODECS),
        (codecs, "table_pull_codec", VALUE_CODECS),
        (publish, "publish_codec", PUBLISH_CODECS),
    ):
        if getattr(section, name) not in choices:
            raise ConfigError(
                f"--{flag(name)}: unknown codec {getattr(section, name)!r}; choose from {choices}"
            )
    dense_codecs = (codecs.dense_push_codec, codecs.dense_pull_codec)
    if consistency.dense_sync == "allreduce" and dense_codecs != ("none", "none"):
        raise ConfigError(
            "--dense-push-codec and --dense-pull-codec code dense traffic with servers: "
            "with --dense-sync allreduce dense parameters never travel to them"
        )
    if not 0 < codecs.topk_ratio <= 1:
        raise ConfigError(f"--topk-ratio must be in (0, 1], got {codecs.topk_ratio}")
    counts: tuple[tuple[object, str], ...] = (
        (tables, "cache_rows"),
        (tables, "cache_lag"),
        (launch, "max_restarts"),
    )
    for owner, name in counts:
        value = getattr(owner, name)
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"--{flag(name)} must be an integer >= 0, got {value!r}")
    if tables.cache_rows and consistency.mode == "sync":
        raise ConfigError(
            "--cache-rows needs --mode async or ssp: sync rounds promise current values"
        )


def _check_checkpoints(checkpoint: CheckpointSection, launch: LaunchSection) -> None:
    """Checkpoints, restarts, and the RPC limits."""
    every, every_s = checkpoint.checkpoint_every, checkpoint.checkpoint_every_s
    if (every or every_s or checkpoint.resume) and checkpoint.checkpoint_dir is None:
        raise ConfigError("--checkpoint-every(-s) and --resume need --checkpoint-dir")
    if every is not None and every < 1:
        raise ConfigError(f"--checkpoint-every must be >= 1, got {every}")
    if every_s is not None and not every_s > 0:
        raise ConfigError(f"--checkpoint-every-s must be > 0, got {every_s}")
    if checkpoint.checkpoint_keep < 2:
        raise ConfigError(f"--checkpoint-keep must be >= 2, got {checkpoint.checkpoint_keep}")
    if not launch.max_message_mb > 0:
        raise ConfigError(f"--max-message-mb must be > 0, got {launch.max_message_mb}")
    if launch.rpc_timeout <= 0:
        raise ConfigError(f"--rpc-timeout must be > 0 seconds, got {launch.rpc_timeout}")


def _check_training(loop: LoopSection, optim: OptimSection, tables: TablesSection) -> None:
    """Update rules, clipping and server-side pooling."""
    if loop.clip_grad_norm is not None and loop.clip_grad_norm <= 0:
        raise ConfigError(f"--clip-grad-norm must be > 0, got {loop.clip_grad_norm}")
    if optim.optimizer == "rowwise_adagrad":
        raise ConfigError(
            "--optimizer: rowwise_adagrad applies to embedding tables only; "
            "use --table-optimizer rowwise_adagrad"
        )
    if tables.server_pooling and (loop.accumulate > 1 or loop.clip_grad_norm is not None):
        raise ConfigError(
            "--server-pooling works with --accumulate 1 and without --clip-grad-norm "
            "(the trainer never sees those tables' row gradients)"
        )


def _check_observing(observe: ObserveSection, tables: TablesSection) -> None:
    """Evaluation, consistency checks and profiling."""
    for name in ("eval_every", "consistency_every"):
        value = getattr(observe, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag(name)} must be >= 1, got {value}")
    if observe.eval_every_s is not None and not observe.eval_every_s > 0:
        raise ConfigError(f"--eval-every-s must be > 0, got {observe.eval_every_s}")
    if observe.profile_steps < 0 or observe.profile_start < 0:
        raise ConfigError("--profile-steps and --profile-start must be >= 0")
    if observe.profile_steps and observe.run_dir is None:
        raise ConfigError("--profile-steps needs --run-dir (the trace is written there)")
    if observe.evaluates_while_training and tables.server_pooling:
        raise ConfigError(
            "--eval-every(-s) does not work with --server-pooling tables (evaluation reads "
            "rows, and those tables' trainers never hold rows)"
        )


def _check_schedules(optim: OptimSection) -> None:
    """Every group's update rule and schedule (building a rule checks its values with
    flag-named errors), and each group's factor at step 0: a bad ``lr_schedule`` is refused
    before the job starts."""
    builtin = optim.builtin_schedule_given()
    if optim.lr_schedule is not None and builtin:
        raise ConfigError(
            f"lr_schedule and {', '.join(sorted(builtin))} both set a schedule: give one"
        )
    optim.dense_optimizer().lr_factor(0, "dense")
    if optim.table_optimizer is not None and optim.table_optimizer not in OPTIMIZERS:
        raise ConfigError(
            f"--table-optimizer: unknown optimizer {optim.table_optimizer!r}; choose from "
            f"{OPTIMIZERS}, as for --optimizer"
        )
    optim.table_optimizer_for("").lr_factor(0, "tables")
    for table in optim.table_optimizers:
        try:
            rule = optim.table_optimizer_for(table)
        except ConfigError as error:
            raise ConfigError(f"table {table!r} ([tables.{table}]): {error}") from None
        rule.lr_factor(0, table)
