"""The job's settings by section, each a frozen dataclass read by one part of the system.

A field is defined once, in its section: its type (a ``Literal`` for a choice), its default and
its help (``metadata["help"]``, which becomes ``--help``; ``cli=False``: no flag). TrainConfig
(:mod:`paramserver.config.train`) is the union of the sections, so a flag, a TOML key and
``config.NAME`` are the section's field; a component is handed its section
(``config.sections.NAME``) and reads nothing else. Values a section derives from its own
fields (the stall limit, whether trainers prefetch) are its properties, computed here once.

- :class:`LaunchSection`: the processes and their RPC (the launchers);
- :class:`ConsistencySection`: the mode, its bounds and rounds, liveness (the coordinator,
  through :class:`~paramserver.config.views.ConsistencySettings`; the trainer's calls);
- :class:`LoopSection`: steps, epochs, batches and what a push holds (the training loop);
- :class:`TablesSection`: bags pooled by the servers, the trainers' row cache;
- :class:`CheckpointSection`: checkpoints (a trainer's :class:`TrainerCheckpoints`);
- :class:`ObserveSection`: progress, metrics, evaluation, checks, traces (the observer);
- :class:`PublishSection`: the change log the servers publish for serving;
- update rules, schedules and codecs: :mod:`paramserver.config.rules`.

Sections check nothing themselves: TrainConfig validates the whole job once
(:mod:`paramserver.config.checks`), since many rules join two sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paramserver.config.choices import DenseSync, Launcher, Mode, PublishCodec

# The most calls one message (a server's ``push_pulls``) may carry: a trainer that pulls every
# few steps (``steps_per_call``) sends their pushes together.
CALLS_PER_MESSAGE = 64
# A trainer stuck in its data or loop (heartbeats going on) is departed after this many
# --trainer-timeout periods without progress: long enough for a slow batch or evaluation.
STALL_TIMEOUT_FACTOR = 6


def doc(text: str, **extra: Any) -> dict[str, Any]:
    """A field's metadata: its ``--help`` text, and ``cli=False`` for a field without a flag."""
    return {"help": text, **extra}


@dataclass(frozen=True, kw_only=True)
class LaunchSection:
    """The job's processes and how they talk: read by the launchers."""

    servers: int = field(default=2, metadata=doc("number of server processes (shards)"))
    trainers: int = field(default=2, metadata=doc("number of trainer processes"))
    launcher: Launcher = field(
        default="auto",
        metadata=doc(
            "auto (torchrun if its environment is set, else processes) | processes | torchrun"
            " | threads (all roles in this process, for tests and notebooks)"
        ),
    )
    seed: int = field(default=0, metadata=doc("seed of model init, data and every process's RNG"))
    rpc_threads: int = field(default=16, metadata=doc("RPC worker threads per process"))
    rpc_timeout: float = field(default=60.0, metadata=doc("RPC call timeout in seconds"))
    data_sockets: bool = field(
        default=True,
        metadata=doc(
            "the calls that move a step's data travel on a socket of their own between each "
            "trainer and server, where the server's RPC agent listens (about 250 us less CPU "
            "a call than RPC); --no-data-sockets sends them over RPC"
        ),
    )
    threads_per_process: int = field(
        default=1, metadata=doc("torch intra-op threads in each server and trainer process")
    )
    max_message_mb: float = field(
        default=1024.0,
        metadata=doc("servers refuse a call whose tensors exceed this many MiB"),
    )
    max_restarts: int = field(
        default=0,
        metadata=doc(
            "processes launcher: restart the whole job this many times after a failure, from "
            "the newest checkpoint (torchrun has its own --max-restarts); with --recover, under "
            "either launcher, a lost server's restarts alone count here too"
        ),
    )
    gather_model: bool = field(
        default=True,
        metadata=doc(
            "gather the final parameters into one process (result.model); refused before the "
            "job starts when the fixed tables and dense parameters take over half the memory "
            "available (MemAvailable in /proc/meminfo): turn off, keep checkpoints with "
            "--checkpoint-dir and write a model with paramserver export"
        ),
    )
    stream_input: bool = field(
        default=False,
        metadata=doc(
            "the trainers read a stream (set by train() from its data_fn): a trainer that "
            "dies stops the job, whose resume reads again what that trainer was handed",
            cli=False,
        ),
    )

    @property
    def world_size(self) -> int:
        return self.servers + self.trainers

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mb * 2**20)


@dataclass(frozen=True, kw_only=True)
class ConsistencySection:
    """How trainers and servers keep in step: the mode and its bounds, where dense parameters
    are kept, prefetching, sync rounds and liveness."""

    mode: Mode = field(
        default="async",
        metadata=doc(
            "consistency: async (no bound) | sync (aggregated rounds) | ssp (stale synchronous "
            "parallel, bounded by --ssp-bound)"
        ),
    )
    dense_sync: DenseSync = field(
        default="server",
        metadata=doc(
            "where dense parameters are kept and updated: server (on the servers, pushed and "
            "pulled every step) | allreduce (on every trainer, their gradients averaged by "
            "all-reduce among the trainers; tables stay on the servers)"
        ),
    )
    prefetch: bool = field(
        default=True,
        metadata=doc(
            "async and ssp (--ssp-bound >= 1): pull the next step's rows while this step computes "
            "(ssp counts that step in its bound; see --prefetch-own-updates); sync never "
            "prefetches"
        ),
    )
    prefetch_own_updates: bool = field(
        default=True,
        metadata=doc(
            "prefetching: apply this trainer's own latest update to the prefetched rows it "
            "touched and to the dense values (the servers send their optimizer state), so "
            "they miss no update of its own; off: they miss its latest push"
        ),
    )
    steps_per_call: int = field(
        default=1,
        metadata=doc(
            "async and ssp: steps a trainer computes from one pull of all their rows, applying "
            "its own updates between them (the servers send the state); their pushes then "
            "travel together with the next pull, one message per server every this many steps "
            "(ssp counts the steps past the pull in its bound; the pull is not prefetched)"
        ),
    )
    ssp_bound: int = field(
        default=2,
        metadata=doc(
            "ssp: steps a trainer may run ahead of the slowest live trainer (was --staleness)"
        ),
    )
    round_deadline: float | None = field(
        default=None,
        metadata=doc(
            "sync and ssp: seconds a round (or an ssp wait) waits for stragglers before going "
            "on with the trainers present (default: wait for all)"
        ),
    )
    min_contributors: int = field(
        default=1, metadata=doc("sync: pushes a round needs before its deadline may close it")
    )
    heartbeat_interval: float = field(
        default=1.0, metadata=doc("seconds between a trainer's heartbeats to each server")
    )
    trainer_timeout: float = field(
        default=10.0,
        metadata=doc(
            "seconds of silence (no call, no heartbeat) after which a trainer is declared "
            "departed: the others stop waiting for it and its later pushes are refused; also "
            "how long a trainer waits for a server's heartbeat answer"
        ),
    )
    stall_timeout: float | None = field(
        default=None,
        metadata=doc(
            "seconds a trainer may make no progress (no batch drawn, no call to a server "
            "made or awaited) while its heartbeats go on, stuck in its data or its loop, "
            "before it is declared departed like a silent one (default: "
            f"{STALL_TIMEOUT_FACTOR} x --trainer-timeout)"
        ),
    )

    @property
    def dense_on_servers(self) -> bool:
        """Whether the servers keep the dense parameters (else every trainer does)."""
        return self.dense_sync == "server"

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
    def servers_ssp_bound(self) -> int | None:
        """The bound the servers hold trainers to, in calls; None unless ssp. With prefetch a
        trainer computes one step past its last call, with steps per call k - 1 steps past its
        last pull: the servers' bound is that much less than ``ssp_bound``."""
        if self.mode != "ssp":
            return None
        return self.ssp_bound - int(self.prefetches) - (self.steps_per_call - 1)

    @property
    def stall_limit(self) -> float:
        """Seconds without progress after which a live trainer is declared departed."""
        if self.stall_timeout is not None:
            return self.stall_timeout
        return STALL_TIMEOUT_FACTOR * self.trainer_timeout


@dataclass(frozen=True, kw_only=True)
class LoopSection:
    """What each trainer's loop does with its data: how many steps, and what one push holds."""

    steps: int | None = field(
        default=None,
        metadata=doc("optimizer steps per trainer at most (default: until data ends)"),
    )
    epochs: int = field(default=1, metadata=doc("passes over each trainer's data"))
    batch_size: int | None = field(
        default=None,
        metadata=doc(
            "samples per batch of paramserver train's datasets (default: 512); ps.train "
            "refuses it: there data_fn makes the batches"
        ),
    )
    clip_grad_norm: float | None = field(
        default=None,
        metadata=doc("clip each push's gradients to this global L2 norm (default: no clipping)"),
    )
    accumulate: int = field(
        default=1, metadata=doc("local batches whose gradients are averaged into one push")
    )


@dataclass(frozen=True, kw_only=True)
class TablesSection:
    """How a table's rows travel besides plain pulls and pushes: bags the servers pool, rows
    the trainers cache."""

    server_pooling: tuple[str, ...] = field(
        default=(),
        metadata=doc(
            "EmbeddingBag tables (sum or mean) whose bags the servers pool: the trainer moves "
            "one vector per bag and server instead of one per row (comma-separated names)"
        ),
    )
    cache_rows: int = field(
        default=0,
        metadata=doc(
            "async and ssp: rows of each table a trainer keeps cached (least recently used "
            "go first; 0: no cache)"
        ),
    )
    cache_lag: int = field(
        default=8,
        metadata=doc(
            "cache lag: a cached row is used while it misses at most this many updates "
            "(was --cache-staleness)"
        ),
    )

    @property
    def served_cache_lag(self) -> int | None:
        """The lag the servers serve trainers' caches with; None: trainers cache nothing."""
        return self.cache_lag if self.cache_rows else None


@dataclass(frozen=True, kw_only=True)
class CheckpointSection:
    """Where and how often the job saves itself, and whether it resumes."""

    checkpoint_dir: str | None = field(
        default=None,
        metadata=doc(
            "directory of checkpoints (shared by every host of a multi-host job): the job's "
            "final model at its end, and more with --checkpoint-every(-s) (default: none, no "
            "checkpoints)"
        ),
    )
    checkpoint_every: int | None = field(
        default=None,
        metadata=doc("checkpoint every this many steps of the chief (default: not by steps)"),
    )
    checkpoint_every_s: float | None = field(
        default=None, metadata=doc("checkpoint every this many seconds (default: not by time)")
    )
    checkpoint_keep: int = field(default=2, metadata=doc("checkpoints kept (at least 2)"))
    resume: bool = field(
        default=False,
        metadata=doc("continue from the newest valid checkpoint in --checkpoint-dir"),
    )

    @property
    def writes_checkpoints(self) -> bool:
        """Whether the job saves checkpoints: a directory, and steps or seconds between them."""
        return self.checkpoint_dir is not None and (
            self.checkpoint_every is not None or self.checkpoint_every_s is not None
        )


@dataclass(frozen=True, kw_only=True)
class ObserveSection:
    """What the job shows and records while it runs: progress, metrics, held-out evaluations,
    replica checks and profiler traces."""

    @property
    def evaluates_while_training(self) -> bool:
        return self.eval_every is not None or self.eval_every_s is not None

    progress: bool = field(
        default=True,
        metadata=doc(
            "show the job's progress: a bar on a terminal, else a log line every --log-every "
            "seconds (ps.train: unless an on_progress callback is given)"
        ),
    )
    log_every: float = field(
        default=10.0, metadata=doc("seconds between progress log lines when not on a terminal")
    )
    run_dir: str | None = field(
        default=None,
        metadata=doc(
            "write the run's metrics (JSON lines, TensorBoard), traces and summary here; "
            "`paramserver report RUN_DIR` plots them (default: none, nothing written)"
        ),
    )
    metrics_every: int = field(
        default=20, metadata=doc("steps between metric records in --run-dir")
    )
    tensorboard: bool = field(
        default=True,
        metadata=doc(
            "also write TensorBoard event files in --run-dir (if tensorboard is installed)"
        ),
    )
    eval_every: int | None = field(
        default=None,
        metadata=doc(
            "steps between held-out evaluations on the chief trainer during training "
            "(the built-in datasets' held-out data; the API's `evaluation`; default: only "
            "the final model is evaluated)"
        ),
    )
    eval_every_s: float | None = field(
        default=None,
        metadata=doc(
            "seconds between held-out evaluations on the chief trainer during training (a "
            "stream's job runs on time, not epochs; with --eval-every, whichever comes first)"
        ),
    )
    consistency_every: int | None = field(
        default=None,
        metadata=doc(
            "steps between checks of each trainer's dense replica against the servers' "
            "current values (how far apart, how many versions behind; default: never)"
        ),
    )
    profile_steps: int = field(
        default=0,
        metadata=doc("record a torch.profiler trace of this many steps per trainer in --run-dir"),
    )
    profile_start: int = field(
        default=10, metadata=doc("the step the profiler trace starts at (after warm-up)")
    )


@dataclass(frozen=True, kw_only=True)
class PublishSection:
    """The change log each server publishes for serving (``paramserver serve --follow``)."""

    publish_dir: str | None = field(
        default=None,
        metadata=doc(
            "publish each server's changed rows and dense values here, for `paramserver serve` "
            "to follow (default: none, nothing published)"
        ),
    )
    publish_every: float = field(
        default=1.0,
        metadata=doc(
            "seconds between a server's change log segments (sync: the chief's rounds, so "
            "every server cuts at the same step)"
        ),
    )
    publish_codec: PublishCodec = field(
        default="none",
        metadata=doc("codec of the published row values (int8: per row, with a bf16 scale)"),
    )
    publish_keep: int = field(
        default=3600,
        metadata=doc(
            "segments each server's log keeps, beyond those since the newest checkpoint "
            "(older ones are deleted: a serving process further behind must restart from a "
            "newer base)"
        ),
    )
    recover: bool = field(
        default=False,
        metadata=doc(
            "a server that dies loses nothing and restarts alone: its log holds what it needs "
            "(rows with their optimizer state, its books), trainers send again what the log "
            "does not hold yet, and the others wait (needs --publish-dir; sync or async; "
            "counted in --max-restarts)"
        ),
    )
    recover_wait: float = field(
        default=300.0,
        metadata=doc(
            "seconds the others wait for a lost server to be restarted and restored before "
            "the job fails"
        ),
    )
