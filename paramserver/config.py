"""Job configuration: frozen dataclasses, validated once, whose field docs become ``--help``.

:class:`TrainConfig` mirrors the ``paramserver train`` flags one to one (``lr`` is ``--lr``,
``rpc_threads`` is ``--rpc-threads``); a TOML file given with ``--config`` supplies the same
keys, and flags override it. Errors name the flag to change.
An update rule's own settings (optimizer, hyper-parameters, schedule) are
:class:`paramserver.optimconfig.OptimizerConfig`, which TrainConfig makes for the dense
parameters and each table.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paramserver.errors import ConfigError
from paramserver.optimconfig import (
    OPTIMIZERS,
    LearningRates,
    OptimizerConfig,
    builtin_schedule_keys,
    refuse_numeric_lr_decay,
)
from paramserver.schedule import (
    DECAYS,
    DEFAULT_DECAY_RATE,
    LrSchedule,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

MODES = ("async", "sync", "ssp")
DENSE_SYNCS = ("server", "allreduce")
# The most calls one message (a server's ``push_pulls``) may carry: a trainer that pulls every
# few steps (``steps_per_call``) sends their pushes together.
CALLS_PER_MESSAGE = 64
LAUNCHERS = ("auto", "processes", "torchrun", "threads")
# The codecs' names, defined once (paramserver.wire.compression implements them): any for dense
# gradients (top-k with error feedback), the others for values, rows and pooled vectors.
GRADIENT_CODECS = ("none", "fp16", "bf16", "int8", "topk")
VALUE_CODECS = ("none", "fp16", "bf16", "int8")
# A trainer stuck in its data or loop (heartbeats going on) is departed after this many
# --trainer-timeout periods without progress: long enough for a slow batch or evaluation.
STALL_TIMEOUT_FACTOR = 6


def _doc(text: str, **extra: Any) -> dict[str, Any]:
    return {"help": text, **extra}


# The settings each component owns, read from the one flat TrainConfig a user writes (flags and
# TOML keys map to it one to one): a component is built from its own view, never the whole.


@dataclass(frozen=True, kw_only=True)
class ConsistencySettings:
    mode: str
    num_trainers: int
    ssp_bound: int | None  # calls a trainer may run ahead, prefetch counted; None unless ssp
    round_deadline: float | None
    min_contributors: int
    trainer_timeout: float
    stall_limit: float
    max_message_bytes: int
    checkpoint_dir: str | None


@dataclass(frozen=True, kw_only=True)
class ShardSettings:
    dense_rule: OptimizerConfig
    table_rules: Mapping[str, OptimizerConfig]  # every table of the model
    table_pull_codecs: Mapping[str, str]
    dense_pull_codec: str
    cache_lag: int | None  # the lag trainers' caches are served with; None: they cache nothing


@dataclass(frozen=True, kw_only=True)
class CheckpointSettings:
    root: str | None
    every_steps: int | None
    every_s: float | None
    keep: int
    job: Mapping[str, Any]  # what a checkpoint records of the job that saved it

    @property
    def enabled(self) -> bool:
        return self.root is not None and (self.every_steps is not None or self.every_s is not None)


@dataclass(frozen=True, kw_only=True)
class ObserveSettings:
    num_servers: int
    run_dir: str | None
    tensorboard: bool
    metrics_every: int
    eval_every: int | None
    consistency_every: int | None
    profile_steps: int
    profile_start: int
    one_process: bool  # the threads launcher: trainers share one process (and one profiler)
    learning_rates: LearningRates  # each group's lr at a step, for the metric records


# The built-in schedule's keys at their "not set" values, as TrainConfig's defaults have them.
_BUILTIN_UNSET: dict[str, Any] = {"warmup_steps": 0, "decay": "none"}


@dataclass(frozen=True)
class TableCodecs:
    """The codecs of one table's row gradients (``push``) and row values (``pull``); None:
    the job's ``--table-push-codec`` / ``--table-pull-codec``."""

    push: str | None = None
    pull: str | None = None

    def __post_init__(self) -> None:
        for direction, codec in (("push", self.push), ("pull", self.pull)):
            if codec is not None and codec not in VALUE_CODECS:
                raise ConfigError(
                    f"{direction} codec {codec!r} for a table: choose from {VALUE_CODECS}"
                )


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a job needs besides the model, the data and the loss."""

    servers: int = field(default=2, metadata=_doc("number of server processes (shards)"))
    trainers: int = field(default=2, metadata=_doc("number of trainer processes"))
    mode: str = field(
        default="async",
        metadata=_doc(
            "consistency: async (no bound) | sync (aggregated rounds) | ssp (stale synchronous "
            "parallel, bounded by --ssp-bound)",
            choices=MODES,
        ),
    )
    dense_sync: str = field(
        default="server",
        metadata=_doc(
            "where dense parameters are kept and updated: server (on the servers, pushed and "
            "pulled every step) | allreduce (on every trainer, their gradients averaged by "
            "all-reduce among the trainers; tables stay on the servers)",
            choices=DENSE_SYNCS,
        ),
    )
    steps: int | None = field(
        default=None,
        metadata=_doc("optimizer steps per trainer at most (default: until data ends)"),
    )
    epochs: int = field(default=1, metadata=_doc("passes over each trainer's data"))
    batch_size: int | None = field(
        default=None,
        metadata=_doc(
            "samples per batch of paramserver train's datasets (default: 512); ps.train "
            "refuses it: there data_fn makes the batches"
        ),
    )
    optimizer: str = field(
        default="adagrad", metadata=_doc("update rule for dense parameters", choices=OPTIMIZERS)
    )
    lr: float = field(default=0.05, metadata=_doc("learning rate for dense parameters"))
    momentum: float = field(default=0.0, metadata=_doc("SGD momentum"))
    weight_decay: float = field(default=0.0, metadata=_doc("weight decay (L2), all optimizers"))
    table_optimizer: str | None = field(
        default=None,
        metadata=_doc(
            "update rule for embedding tables (default: --optimizer)", choices=OPTIMIZERS
        ),
    )
    table_lr: float | None = field(
        default=None, metadata=_doc("learning rate for embedding tables (default: --lr)")
    )
    lr_warmup_steps: int = field(
        default=0,
        metadata=_doc(
            "learning-rate warm-up: step s < N (0 for a trainer's first step) is applied at "
            "(s + 1) / N of the lr; dense parameters and tables alike, unless a [tables.NAME] "
            "section sets a schedule of its own"
        ),
    )
    lr_decay: str = field(
        default="none",
        metadata=_doc(
            "learning-rate decay after the warm-up, over --lr-decay-steps: linear and cosine "
            "go from the lr down to the floor (--lr-min or --lr-min-ratio, default 0) and stay "
            "there; exponential multiplies it by --lr-decay-rate every --lr-decay-steps steps, "
            "smoothly, step by whole periods; both floored. A step is a trainer's training "
            "step: in sync mode a round's, in async and ssp each push's own trainer's; it "
            "continues on resume",
            choices=DECAYS,
        ),
    )
    lr_decay_steps: int | None = field(
        default=None,
        metadata=_doc(
            "steps of the decay: linear and cosine reach the floor after them; exponential and "
            "step decay by --lr-decay-rate per this many steps (needed by every --lr-decay but "
            "none)"
        ),
    )
    lr_decay_rate: float | None = field(
        default=None,
        metadata=_doc(
            "exponential and step decay: the factor per --lr-decay-steps steps, in (0, 1] "
            f"(default: {DEFAULT_DECAY_RATE})"
        ),
    )
    lr_min: float | None = field(
        default=None,
        metadata=_doc(
            "the floor of the decay as a learning rate, for each group at most its lr "
            "(default: 0; or --lr-min-ratio)"
        ),
    )
    lr_min_ratio: float | None = field(
        default=None,
        metadata=_doc(
            "the floor of the decay as a ratio of each group's lr, in [0, 1] (default: 0; or "
            "--lr-min)"
        ),
    )
    lr_schedule: LrSchedule | None = field(
        default=None,
        metadata=_doc(
            "Python only: a function of the training step (0 for the first update, as "
            "torch.optim.lr_scheduler.LambdaLR's) returning a factor of the lr, for dense "
            "parameters and tables (unless a table's OptimizerConfig sets its own), instead of "
            "the built-in schedule (--lr-warmup-steps, --lr-decay ...); checked at step 0 when "
            "the config is made, and at every step on the servers: a factor that is not a "
            "finite number >= 0 stops the job with a ConfigError naming the step and the "
            "group, the update not applied. Servers call it from several threads at once: "
            "keep it a pure function of the step",
            cli=False,
        ),
    )
    table_optimizers: Mapping[str, OptimizerConfig] = field(
        default_factory=dict,
        metadata=_doc(
            "per-table optimizers, with their schedules, by table name (TOML [tables.NAME] "
            "sections; a table whose rule sets no schedule key takes the job's schedule)",
            cli=False,
        ),
    )
    server_pooling: tuple[str, ...] = field(
        default=(),
        metadata=_doc(
            "EmbeddingBag tables (sum or mean) whose bags the servers pool: the trainer moves "
            "one vector per bag and server instead of one per row (comma-separated names)"
        ),
    )
    seed: int = field(default=0, metadata=_doc("seed of model init, data and every process's RNG"))
    clip_grad_norm: float | None = field(
        default=None,
        metadata=_doc("clip each push's gradients to this global L2 norm (default: no clipping)"),
    )
    accumulate: int = field(
        default=1, metadata=_doc("local batches whose gradients are averaged into one push")
    )
    prefetch: bool = field(
        default=True,
        metadata=_doc(
            "async and ssp (--ssp-bound >= 1): pull the next step's rows while this step computes "
            "(ssp counts that step in its bound; see --prefetch-own-updates); sync never "
            "prefetches"
        ),
    )
    prefetch_own_updates: bool = field(
        default=True,
        metadata=_doc(
            "prefetching: apply this trainer's own latest update to the prefetched rows it "
            "touched and to the dense values (the servers send their optimizer state), so "
            "they miss no update of its own; off: they miss its latest push"
        ),
    )
    steps_per_call: int = field(
        default=1,
        metadata=_doc(
            "async and ssp: steps a trainer computes from one pull of all their rows, applying "
            "its own updates between them (the servers send the state); their pushes then "
            "travel together with the next pull, one message per server every this many steps "
            "(ssp counts the steps past the pull in its bound; the pull is not prefetched)"
        ),
    )
    ssp_bound: int = field(
        default=2,
        metadata=_doc(
            "ssp: steps a trainer may run ahead of the slowest live trainer (was --staleness)"
        ),
    )
    round_deadline: float | None = field(
        default=None,
        metadata=_doc(
            "sync and ssp: seconds a round (or an ssp wait) waits for stragglers before going "
            "on with the trainers present (default: wait for all)"
        ),
    )
    min_contributors: int = field(
        default=1, metadata=_doc("sync: pushes a round needs before its deadline may close it")
    )
    heartbeat_interval: float = field(
        default=1.0, metadata=_doc("seconds between a trainer's heartbeats to each server")
    )
    trainer_timeout: float = field(
        default=10.0,
        metadata=_doc(
            "seconds of silence (no call, no heartbeat) after which a trainer is declared "
            "departed: the others stop waiting for it and its later pushes are refused; also "
            "how long a trainer waits for a server's heartbeat answer"
        ),
    )
    stall_timeout: float | None = field(
        default=None,
        metadata=_doc(
            "seconds a trainer may make no progress (no batch drawn, no call to a server "
            "made or awaited) while its heartbeats go on, stuck in its data or its loop, "
            "before it is declared departed like a silent one (default: "
            f"{STALL_TIMEOUT_FACTOR} x --trainer-timeout)"
        ),
    )
    dense_push_codec: str = field(
        default="none",
        metadata=_doc(
            "codec of dense gradients sent to servers, with error feedback",
            choices=GRADIENT_CODECS,
        ),
    )
    dense_pull_codec: str = field(
        default="none",
        metadata=_doc("codec of dense values sent to trainers", choices=VALUE_CODECS),
    )
    table_push_codec: str = field(
        default="none",
        metadata=_doc(
            "codec of embedding-row gradients (no error feedback: a row's next gradient may "
            "be far off)",
            choices=VALUE_CODECS,
        ),
    )
    table_pull_codec: str = field(
        default="none",
        metadata=_doc("codec of embedding rows sent to trainers", choices=VALUE_CODECS),
    )
    table_codecs: Mapping[str, TableCodecs] = field(
        default_factory=dict,
        metadata=_doc(
            "per-table codecs by table name (TOML [tables.NAME] push_codec / pull_codec)",
            cli=False,
        ),
    )
    topk_ratio: float = field(
        default=0.01, metadata=_doc("fraction of each dense gradient top-k sends")
    )
    cache_rows: int = field(
        default=0,
        metadata=_doc(
            "async and ssp: rows of each table a trainer keeps cached (least recently used "
            "go first; 0: no cache)"
        ),
    )
    cache_lag: int = field(
        default=8,
        metadata=_doc(
            "cache lag: a cached row is used while it misses at most this many updates "
            "(was --cache-staleness)"
        ),
    )
    checkpoint_dir: str | None = field(
        default=None,
        metadata=_doc(
            "directory of checkpoints (shared by every host of a multi-host job; default: "
            "none, no checkpoints)"
        ),
    )
    checkpoint_every: int | None = field(
        default=None,
        metadata=_doc("checkpoint every this many steps of the chief (default: not by steps)"),
    )
    checkpoint_every_s: float | None = field(
        default=None, metadata=_doc("checkpoint every this many seconds (default: not by time)")
    )
    checkpoint_keep: int = field(default=2, metadata=_doc("checkpoints kept (at least 2)"))
    resume: bool = field(
        default=False,
        metadata=_doc("continue from the newest valid checkpoint in --checkpoint-dir"),
    )
    max_restarts: int = field(
        default=0,
        metadata=_doc(
            "processes launcher: restart the whole job this many times after a failure, from "
            "the newest checkpoint (torchrun has its own --max-restarts)"
        ),
    )
    max_message_mb: float = field(
        default=1024.0,
        metadata=_doc("servers refuse a call whose tensors exceed this many MiB"),
    )
    rpc_threads: int = field(default=16, metadata=_doc("RPC worker threads per process"))
    rpc_timeout: float = field(default=60.0, metadata=_doc("RPC call timeout in seconds"))
    threads_per_process: int = field(
        default=1, metadata=_doc("torch intra-op threads in each server and trainer process")
    )
    launcher: str = field(
        default="auto",
        metadata=_doc(
            "auto (torchrun if its environment is set, else processes) | processes | torchrun"
            " | threads (all roles in this process, for tests and notebooks)",
            choices=LAUNCHERS,
        ),
    )
    gather_model: bool = field(
        default=True,
        metadata=_doc(
            "gather the final parameters into one process (result.model); refused before the "
            "job starts when the fixed tables and dense parameters take over half the memory "
            "available (MemAvailable in /proc/meminfo): turn off, keep checkpoints with "
            "--checkpoint-dir and write a model with paramserver export"
        ),
    )
    progress: bool = field(
        default=True,
        metadata=_doc(
            "show the job's progress: a bar on a terminal, else a log line every --log-every "
            "seconds (ps.train: unless an on_progress callback is given)"
        ),
    )
    log_every: float = field(
        default=10.0, metadata=_doc("seconds between progress log lines when not on a terminal")
    )
    run_dir: str | None = field(
        default=None,
        metadata=_doc(
            "write the run's metrics (JSON lines, TensorBoard), traces and summary here; "
            "`paramserver report RUN_DIR` plots them (default: none, nothing written)"
        ),
    )
    metrics_every: int = field(
        default=20, metadata=_doc("steps between metric records in --run-dir")
    )
    tensorboard: bool = field(
        default=True,
        metadata=_doc(
            "also write TensorBoard event files in --run-dir (if tensorboard is installed)"
        ),
    )
    eval_every: int | None = field(
        default=None,
        metadata=_doc(
            "steps between held-out evaluations on the chief trainer during training "
            "(the built-in datasets' held-out data; the API's `evaluation`; default: only "
            "the final model is evaluated)"
        ),
    )
    consistency_every: int | None = field(
        default=None,
        metadata=_doc(
            "steps between checks of each trainer's dense replica against the servers' "
            "current values (how far apart, how many versions behind; default: never)"
        ),
    )
    profile_steps: int = field(
        default=0,
        metadata=_doc("record a torch.profiler trace of this many steps per trainer in --run-dir"),
    )
    profile_start: int = field(
        default=10, metadata=_doc("the step the profiler trace starts at (after warm-up)")
    )

    def __post_init__(self) -> None:
        if isinstance(self.server_pooling, str | list):  # from a flag or a TOML array
            names = self.server_pooling
            names = names.split(",") if isinstance(names, str) else names
            object.__setattr__(self, "server_pooling", tuple(n for n in names if n))
        if not all(isinstance(n, str) for n in self.server_pooling):
            raise ConfigError("--server-pooling takes table names")
        refuse_numeric_lr_decay(self.lr_decay)
        _check_types(self)
        self._check_counts()
        self._check_consistency()
        self._check_codecs()
        self._check_checkpoints()
        self._check_training()
        self._check_observing()
        self._check_schedules()

    def _check_counts(self) -> None:
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
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"--{_flag(name)} must be an integer >= 1, got {value!r}")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        if not self.log_every > 0:
            raise ConfigError(f"--log-every must be > 0 seconds, got {self.log_every}")

    def _check_consistency(self) -> None:
        """Mode, launcher, rounds, and the limits of liveness."""
        if self.mode not in MODES:
            raise ConfigError(f"--mode: unknown mode {self.mode!r}; choose from {MODES}")
        if self.launcher not in LAUNCHERS:
            raise ConfigError(
                f"--launcher: unknown launcher {self.launcher!r}; choose from {LAUNCHERS}"
            )
        if self.dense_sync not in DENSE_SYNCS:
            raise ConfigError(
                f"--dense-sync: unknown value {self.dense_sync!r}; choose from {DENSE_SYNCS}"
            )
        if not isinstance(self.ssp_bound, int) or self.ssp_bound < 0:
            raise ConfigError(f"--ssp-bound must be an integer >= 0, got {self.ssp_bound!r}")
        self._check_steps_per_call()
        if self.round_deadline is not None and not self.round_deadline > 0:
            raise ConfigError(f"--round-deadline must be > 0 seconds, got {self.round_deadline}")
        if self.min_contributors > self.trainers:
            raise ConfigError(
                f"--min-contributors {self.min_contributors} exceeds --trainers {self.trainers}"
            )
        if not self.heartbeat_interval > 0:
            raise ConfigError(
                f"--heartbeat-interval must be > 0 seconds, got {self.heartbeat_interval}"
            )
        if not self.trainer_timeout >= 2 * self.heartbeat_interval:
            raise ConfigError(
                f"--trainer-timeout ({self.trainer_timeout} s) must be at least twice "
                f"--heartbeat-interval ({self.heartbeat_interval} s)"
            )
        if self.stall_timeout is not None and not self.stall_timeout >= self.trainer_timeout:
            raise ConfigError(
                f"--stall-timeout ({self.stall_timeout} s) must be at least --trainer-timeout "
                f"({self.trainer_timeout} s)"
            )

    def _check_steps_per_call(self) -> None:
        k = self.steps_per_call
        if not isinstance(k, int) or not 1 <= k <= CALLS_PER_MESSAGE:
            raise ConfigError(
                f"--steps-per-call must be an integer from 1 to {CALLS_PER_MESSAGE}, got {k!r}"
            )
        if k == 1:
            return
        if self.mode == "sync":
            raise ConfigError(
                "--steps-per-call > 1 needs --mode async or ssp: sync applies every trainer's "
                "step before the next, so each step needs a pull of its own"
            )
        if self.mode == "ssp" and self.ssp_bound < k - 1:
            raise ConfigError(
                f"--steps-per-call {k} computes {k - 1} steps past each pull: it needs "
                f"--ssp-bound >= {k - 1}, got {self.ssp_bound}"
            )
        if self.server_pooling:
            raise ConfigError(
                "--steps-per-call > 1 does not work with --server-pooling (the servers pool "
                "one step's bags per pull)"
            )
        if self.dense_sync == "allreduce":
            raise ConfigError(
                "--steps-per-call > 1 does not work with --dense-sync allreduce (its "
                "all-reduce goes with each call)"
            )

    def _check_codecs(self) -> None:
        """Codecs on the wire and the trainers' row cache."""
        for name, codecs in (
            ("dense_push_codec", GRADIENT_CODECS),
            ("dense_pull_codec", VALUE_CODECS),
            ("table_push_codec", VALUE_CODECS),
            ("table_pull_codec", VALUE_CODECS),
        ):
            if getattr(self, name) not in codecs:
                raise ConfigError(
                    f"--{_flag(name)}: unknown codec {getattr(self, name)!r}; choose from {codecs}"
                )
        dense_codecs = (self.dense_push_codec, self.dense_pull_codec)
        if self.dense_sync == "allreduce" and dense_codecs != ("none", "none"):
            raise ConfigError(
                "--dense-push-codec and --dense-pull-codec code dense traffic with servers: "
                "with --dense-sync allreduce dense parameters never travel to them"
            )
        if not 0 < self.topk_ratio <= 1:
            raise ConfigError(f"--topk-ratio must be in (0, 1], got {self.topk_ratio}")
        for name in ("cache_rows", "cache_lag", "max_restarts"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"--{_flag(name)} must be an integer >= 0, got {value!r}")
        if self.cache_rows and self.mode == "sync":
            raise ConfigError(
                "--cache-rows needs --mode async or ssp: sync rounds promise current values"
            )

    def _check_checkpoints(self) -> None:
        """Checkpoints, restarts, and the RPC limits."""
        if (self.checkpoint_every or self.checkpoint_every_s or self.resume) and (
            self.checkpoint_dir is None
        ):
            raise ConfigError("--checkpoint-every(-s) and --resume need --checkpoint-dir")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ConfigError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")
        if self.checkpoint_every_s is not None and not self.checkpoint_every_s > 0:
            raise ConfigError(f"--checkpoint-every-s must be > 0, got {self.checkpoint_every_s}")
        if self.checkpoint_keep < 2:
            raise ConfigError(f"--checkpoint-keep must be >= 2, got {self.checkpoint_keep}")
        if not self.max_message_mb > 0:
            raise ConfigError(f"--max-message-mb must be > 0, got {self.max_message_mb}")
        if self.rpc_timeout <= 0:
            raise ConfigError(f"--rpc-timeout must be > 0 seconds, got {self.rpc_timeout}")

    def _check_training(self) -> None:
        """Update rules, clipping and server-side pooling."""
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise ConfigError(f"--clip-grad-norm must be > 0, got {self.clip_grad_norm}")
        if self.optimizer == "rowwise_adagrad":
            raise ConfigError(
                "--optimizer: rowwise_adagrad applies to embedding tables only; "
                "use --table-optimizer rowwise_adagrad"
            )
        if self.server_pooling and (self.accumulate > 1 or self.clip_grad_norm is not None):
            raise ConfigError(
                "--server-pooling works with --accumulate 1 and without --clip-grad-norm "
                "(the trainer never sees those tables' row gradients)"
            )

    def _check_observing(self) -> None:
        """Evaluation, consistency checks and profiling."""
        for name in ("eval_every", "consistency_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{_flag(name)} must be >= 1, got {value}")
        if self.profile_steps < 0 or self.profile_start < 0:
            raise ConfigError("--profile-steps and --profile-start must be >= 0")
        if self.profile_steps and self.run_dir is None:
            raise ConfigError("--profile-steps needs --run-dir (the trace is written there)")
        if self.eval_every is not None and self.server_pooling:
            raise ConfigError(
                "--eval-every does not work with --server-pooling tables (evaluation reads "
                "rows, and those tables' trainers never hold rows)"
            )

    def _check_schedules(self) -> None:
        """Every group's update rule and schedule (building a rule checks its values with
        flag-named errors), and each group's factor at step 0: a bad ``lr_schedule`` is
        refused before the job starts."""
        builtin = {
            f"lr_{k}": v
            for k, v in self._schedule_keys(builtin=True).items()
            if v != _BUILTIN_UNSET.get(k)
        }
        if self.lr_schedule is not None and builtin:
            raise ConfigError(
                f"lr_schedule and {', '.join(sorted(builtin))} both set a schedule: give one"
            )
        self.dense_optimizer().lr_factor(0, "dense")
        self.table_optimizer_for("").lr_factor(0, "tables")
        for table in self.table_optimizers:
            try:
                rule = self.table_optimizer_for(table)
            except ConfigError as error:
                raise ConfigError(f"table {table!r} ([tables.{table}]): {error}") from None
            rule.lr_factor(0, table)

    def _schedule_keys(self, builtin: bool = False) -> dict[str, Any]:
        """The job's schedule as OptimizerConfig keys (``builtin``: the built-in's keys, as
        :class:`Schedule` names them, even with ``lr_schedule`` set)."""
        if self.lr_schedule is not None and not builtin:
            return {"lr_schedule": self.lr_schedule}
        keys = builtin_schedule_keys(self)
        return keys if builtin else {f"lr_{k}": v for k, v in keys.items()}

    @property
    def dense_on_servers(self) -> bool:
        """Whether the servers keep the dense parameters (else every trainer does)."""
        return self.dense_sync == "server"

    def dense_optimizer(self) -> OptimizerConfig:
        return OptimizerConfig(
            name=self.optimizer,
            lr=self.lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            **self._schedule_keys(),
        )

    def table_optimizer_for(self, table: str) -> OptimizerConfig:
        """The rule of ``table``: its own (``table_optimizers``; with the job's schedule
        unless it sets one), else the job's table rule (``--table-optimizer``, ``--table-lr``)
        with the job's schedule."""
        own = self.table_optimizers.get(table)
        if own is not None:
            return own if own.sets_schedule else dataclasses.replace(own, **self._schedule_keys())
        return OptimizerConfig(
            name=self.table_optimizer or self.optimizer,
            lr=self.table_lr if self.table_lr is not None else self.lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            **self._schedule_keys(),
        )

    @property
    def learning_rates(self) -> LearningRates:
        """Each group's rule, for the learning rate it applies at a step."""
        return LearningRates(
            dense=self.dense_optimizer(),
            own={name: self.table_optimizer_for(name) for name in self.table_optimizers},
            default=self.table_optimizer_for(""),
        )

    def codecs_for_table(self, table: str) -> tuple[str, str]:
        """The (push, pull) codecs of ``table``."""
        own = self.table_codecs.get(table, TableCodecs())
        return own.push or self.table_push_codec, own.pull or self.table_pull_codec

    def check_tables(self, tables: Collection[str]) -> None:
        """Fail if a per-table option names a table the model does not have."""
        named = set(self.table_optimizers) | set(self.server_pooling) | set(self.table_codecs)
        unknown = sorted(named - set(tables))
        if unknown:
            raise ConfigError(
                f"the job names tables {unknown}, which the model does not have; its tables are "
                f"{sorted(tables)}"
            )

    @property
    def stall_limit(self) -> float:
        """Seconds without progress after which a live trainer is declared departed."""
        if self.stall_timeout is not None:
            return self.stall_timeout
        return STALL_TIMEOUT_FACTOR * self.trainer_timeout

    @property
    def prefetches(self) -> bool:
        """Whether trainers prefetch: sync never does, ssp only with a bound to spend on it,
        nor a trainer that pulls every few steps."""
        return (
            self.prefetch
            and self.steps_per_call == 1
            and (self.mode == "async" or (self.mode == "ssp" and self.ssp_bound >= 1))
        )

    @property
    def world_size(self) -> int:
        return self.servers + self.trainers

    @property
    def consistency(self) -> ConsistencySettings:
        """What a server's coordinator needs: when to apply and answer, whom to wait for."""
        return ConsistencySettings(
            mode=self.mode,
            num_trainers=self.trainers,
            # With prefetch a trainer computes one step past its last call, with steps per
            # call k - 1 steps past its last pull: the servers' bound is that much less.
            ssp_bound=(
                self.ssp_bound - int(self.prefetches) - (self.steps_per_call - 1)
                if self.mode == "ssp"
                else None
            ),
            round_deadline=self.round_deadline,
            min_contributors=self.min_contributors,
            trainer_timeout=self.trainer_timeout,
            stall_limit=self.stall_limit,
            max_message_bytes=int(self.max_message_mb * 2**20),
            checkpoint_dir=self.checkpoint_dir,
        )

    def shard_settings(self, tables: Collection[str]) -> ShardSettings:
        """What a server's shard needs: each parameter's update rule and pull codec."""
        return ShardSettings(
            dense_rule=self.dense_optimizer(),
            table_rules={name: self.table_optimizer_for(name) for name in tables},
            table_pull_codecs={name: self.codecs_for_table(name)[1] for name in tables},
            dense_pull_codec=self.dense_pull_codec,
            cache_lag=self.cache_lag if self.cache_rows else None,
        )

    @property
    def checkpointing(self) -> CheckpointSettings:
        """What a trainer needs to schedule, write and commit checkpoints."""
        return CheckpointSettings(
            root=self.checkpoint_dir,
            every_steps=self.checkpoint_every,
            every_s=self.checkpoint_every_s,
            keep=self.checkpoint_keep,
            job={"servers": self.servers, "trainers": self.trainers, "mode": self.mode},
        )

    @property
    def observing(self) -> ObserveSettings:
        """What a trainer's observer needs: metrics, evaluation, consistency checks, traces."""
        return ObserveSettings(
            num_servers=self.servers,
            run_dir=self.run_dir,
            tensorboard=self.tensorboard,
            metrics_every=self.metrics_every,
            eval_every=self.eval_every,
            consistency_every=self.consistency_every,
            profile_steps=self.profile_steps,
            profile_start=self.profile_start,
            one_process=self.launcher == "threads",
            learning_rates=self.learning_rates,
        )

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


def _flag(field_name: str) -> str:
    return field_name.replace("_", "-")


_SIMPLE_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def _check_types(config: TrainConfig) -> None:
    """Values from a TOML file arrive untyped: name the field whose value has the wrong type."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        kinds = str(f.type).replace(" ", "").split("|")
        if value is None and "None" in kinds:
            continue
        allowed = tuple(t for kind in kinds for t in _SIMPLE_TYPES.get(kind, ()))
        if not allowed:
            continue  # a structured field, checked where it is used
        if isinstance(value, bool) and bool not in allowed:
            allowed = ()
        if not isinstance(value, allowed):
            raise ConfigError(
                f"--{_flag(f.name)} must be of type {f.type}, got {type(value).__name__} {value!r}"
            )


def config_fields() -> list[dataclasses.Field[Any]]:
    return list(dataclasses.fields(TrainConfig))


# Fields given a new name (one name per idea), old -> new: the old name, as a flag or a TOML
# key, is refused with a message naming the new one.
RENAMED_FIELDS = {"cache_staleness": "cache_lag", "staleness": "ssp_bound"}
_dataclass_init = TrainConfig.__init__


def _init_naming_renamed_fields(self: TrainConfig, **fields: Any) -> None:
    """TrainConfig(...) as the dataclass builds it, but a renamed field is a ConfigError
    naming its new name (not Python's bare "unexpected keyword")."""
    for old, new in RENAMED_FIELDS.items():
        if old in fields:
            raise ConfigError(f"TrainConfig: {old!r} was renamed {new!r}")
    _dataclass_init(self, **fields)


TrainConfig.__init__ = _init_naming_renamed_fields  # type: ignore[method-assign]


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML job file into TrainConfig keyword arguments (flags are applied on top).

    Keys are TrainConfig field names with ``_`` or ``-``; ``[tables.NAME]`` sections set
    per-table optimizers. Unknown keys are errors, so a typo never silently does nothing.
    """
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config: file not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config: {path} is not valid TOML: {e}") from None
    known = {f.name for f in config_fields()}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name in RENAMED_FIELDS:
            raise ConfigError(
                f"--config: key {key!r} in {path} was renamed {RENAMED_FIELDS[name]!r}"
            )
        if name == "tables":
            if not isinstance(value, dict):
                raise ConfigError(f"--config: [tables] in {path} must be a table of tables")
            values["table_optimizers"], values["table_codecs"] = _table_sections(value, path)
        elif name in known:
            values[name] = value
        else:
            raise ConfigError(f"--config: unknown key {key!r} in {path}; known: {sorted(known)}")
    return values


def _table_sections(
    sections: dict[str, Any], path: str | Path
) -> tuple[dict[str, OptimizerConfig], dict[str, TableCodecs]]:
    """``[tables.NAME]``: optimizer keys make a per-table optimizer; ``push_codec`` and
    ``pull_codec`` per-table codecs."""
    optimizers, codecs = {}, {}
    for table, spec in sections.items():
        where = f"--config [tables.{table}]"
        if not isinstance(spec, dict):
            raise ConfigError(f"{where} in {path} must be a table of keys")
        spec = dict(spec)
        chosen = {k: spec.pop(k) for k in ("push_codec", "pull_codec") if k in spec}
        if chosen:
            try:
                codecs[table] = TableCodecs(chosen.get("push_codec"), chosen.get("pull_codec"))
            except ConfigError as error:
                raise ConfigError(f"{where}: {error}") from None
        if spec:
            optimizers[table] = OptimizerConfig.from_mapping(spec, where)
    return optimizers, codecs
