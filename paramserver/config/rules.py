"""The two sections that can differ table by table (a TOML file's ``[tables.NAME]``): the
update rules with their learning-rate schedules (:class:`OptimSection`), and the codecs of what
travels (:class:`CodecsSection`). Each resolves a table's own setting against the job's here,
once: servers build their shard from what these give, trainers their own updates and pushes.
See :mod:`paramserver.config.sections` for how sections make up TrainConfig.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from paramserver.config.choices import VALUE_CODECS, GradientCodec, ValueCodec
from paramserver.config.sections import doc
from paramserver.errors import ConfigError
from paramserver.optimconfig import (
    LearningRates,
    OptimizerConfig,
    OptimizerName,
    builtin_schedule_keys,
)
from paramserver.schedule import DEFAULT_DECAY_RATE, Decay, LrSchedule

# The built-in schedule's keys at their "not set" values, as the section's defaults have them.
_BUILTIN_UNSET: dict[str, Any] = {"warmup_steps": 0, "decay": "none"}


@dataclass(frozen=True, kw_only=True)
class OptimSection:
    """The update rules of the dense parameters and the tables, and their learning-rate
    schedule: read by the servers (each parameter's rule), by a trainer applying its own
    updates, and for the learning rates a run records."""

    optimizer: OptimizerName = field(
        default="adagrad", metadata=doc("update rule for dense parameters")
    )
    lr: float = field(default=0.05, metadata=doc("learning rate for dense parameters"))
    momentum: float = field(default=0.0, metadata=doc("SGD momentum"))
    weight_decay: float = field(default=0.0, metadata=doc("weight decay (L2), all optimizers"))
    table_optimizer: OptimizerName | None = field(
        default=None, metadata=doc("update rule for embedding tables (default: --optimizer)")
    )
    table_lr: float | None = field(
        default=None, metadata=doc("learning rate for embedding tables (default: --lr)")
    )
    lr_warmup_steps: int = field(
        default=0,
        metadata=doc(
            "learning-rate warm-up: step s < N (0 for a trainer's first step) is applied at "
            "(s + 1) / N of the lr; dense parameters and tables alike, unless a [tables.NAME] "
            "section sets a schedule of its own"
        ),
    )
    lr_decay: Decay = field(
        default="none",
        metadata=doc(
            "learning-rate decay after the warm-up, over --lr-decay-steps: linear and cosine "
            "go from the lr down to the floor (--lr-min or --lr-min-ratio, default 0) and stay "
            "there; exponential multiplies it by --lr-decay-rate every --lr-decay-steps steps, "
            "smoothly, step by whole periods; both floored. A step is a trainer's training "
            "step: in sync mode a round's, in async and ssp each push's own trainer's; it "
            "continues on resume"
        ),
    )
    lr_decay_steps: int | None = field(
        default=None,
        metadata=doc(
            "steps of the decay: linear and cosine reach the floor after them; exponential and "
            "step decay by --lr-decay-rate per this many steps (needed by every --lr-decay but "
            "none)"
        ),
    )
    lr_decay_rate: float | None = field(
        default=None,
        metadata=doc(
            "exponential and step decay: the factor per --lr-decay-steps steps, in (0, 1] "
            f"(default: {DEFAULT_DECAY_RATE})"
        ),
    )
    lr_min: float | None = field(
        default=None,
        metadata=doc(
            "the floor of the decay as a learning rate, for each group at most its lr "
            "(default: 0; or --lr-min-ratio)"
        ),
    )
    lr_min_ratio: float | None = field(
        default=None,
        metadata=doc(
            "the floor of the decay as a ratio of each group's lr, in [0, 1] (default: 0; or "
            "--lr-min)"
        ),
    )
    lr_schedule: LrSchedule | None = field(
        default=None,
        metadata=doc(
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
        metadata=doc(
            "per-table optimizers, with their schedules, by table name (TOML [tables.NAME] "
            "sections; a table whose rule sets no schedule key takes the job's schedule)",
            cli=False,
        ),
    )

    def schedule_keys(self, builtin: bool = False) -> dict[str, Any]:
        """The job's schedule as OptimizerConfig keys (``builtin``: the built-in's keys, as
        :class:`Schedule` names them, even with ``lr_schedule`` set)."""
        if self.lr_schedule is not None and not builtin:
            return {"lr_schedule": self.lr_schedule}
        keys = builtin_schedule_keys(self)
        return keys if builtin else {f"lr_{k}": v for k, v in keys.items()}

    def builtin_schedule_given(self) -> dict[str, Any]:
        """The built-in schedule's fields set away from their defaults, by field name."""
        return {
            f"lr_{k}": v
            for k, v in self.schedule_keys(builtin=True).items()
            if v != _BUILTIN_UNSET.get(k)
        }

    def dense_optimizer(self) -> OptimizerConfig:
        return OptimizerConfig(
            name=self.optimizer,
            lr=self.lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            **self.schedule_keys(),
        )

    def table_optimizer_for(self, table: str) -> OptimizerConfig:
        """The rule of ``table``: its own (``table_optimizers``; with the job's schedule
        unless it sets one), else the job's table rule (``--table-optimizer``, ``--table-lr``)
        with the job's schedule."""
        own = self.table_optimizers.get(table)
        if own is not None:
            return own if own.sets_schedule else dataclasses.replace(own, **self.schedule_keys())
        return OptimizerConfig(
            name=self.table_optimizer or self.optimizer,
            lr=self.table_lr if self.table_lr is not None else self.lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            **self.schedule_keys(),
        )

    @property
    def learning_rates(self) -> LearningRates:
        """Each group's rule, for the learning rate it applies at a step."""
        return LearningRates(
            dense=self.dense_optimizer(),
            own={name: self.table_optimizer_for(name) for name in self.table_optimizers},
            default=self.table_optimizer_for(""),
        )


@dataclass(frozen=True)
class TableCodecs:
    """The codecs of one table's row gradients (``push``) and row values (``pull``); None:
    the job's ``--table-push-codec`` / ``--table-pull-codec``."""

    push: ValueCodec | None = None
    pull: ValueCodec | None = None

    def __post_init__(self) -> None:
        for direction, codec in (("push", self.push), ("pull", self.pull)):
            if codec is not None and codec not in VALUE_CODECS:
                raise ConfigError(
                    f"{direction} codec {codec!r} for a table: choose from {VALUE_CODECS}"
                )


@dataclass(frozen=True, kw_only=True)
class CodecsSection:
    """How values are coded on the wire, each way: read by trainers for what they push
    (:class:`~paramserver.trainer.client.PushCodecs`) and by servers for what they send."""

    dense_push_codec: GradientCodec = field(
        default="none",
        metadata=doc("codec of dense gradients sent to servers, with error feedback"),
    )
    dense_pull_codec: ValueCodec = field(
        default="none", metadata=doc("codec of dense values sent to trainers")
    )
    table_push_codec: ValueCodec = field(
        default="none",
        metadata=doc(
            "codec of embedding-row gradients (no error feedback: a row's next gradient may "
            "be far off)"
        ),
    )
    table_pull_codec: ValueCodec = field(
        default="none", metadata=doc("codec of embedding rows sent to trainers")
    )
    table_codecs: Mapping[str, TableCodecs] = field(
        default_factory=dict,
        metadata=doc(
            "per-table codecs by table name (TOML [tables.NAME] push_codec / pull_codec)",
            cli=False,
        ),
    )
    topk_ratio: float = field(
        default=0.01, metadata=doc("fraction of each dense gradient top-k sends")
    )

    def codecs_for_table(self, table: str) -> tuple[ValueCodec, ValueCodec]:
        """The (push, pull) codecs of ``table``."""
        own = self.table_codecs.get(table, TableCodecs())
        return own.push or self.table_push_codec, own.pull or self.table_pull_codec
