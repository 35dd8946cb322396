"""A job's settings as its components take them: :class:`Sections`, one object per section
(what the checks read, and what each component is handed its part of), and what a server's two
components are built from: values derived from several sections, each derived here and nowhere
else.

The coordinator's :class:`ConsistencySettings` hold the bound servers enforce (the
``--ssp-bound`` less what prefetching and steps per call spend of it), the stall limit and
the message limit in bytes; the shard's :class:`ShardSettings` hold each table's resolved
update rule and pull codec, and the lag of the trainers' caches. The trainer's components take
their sections themselves (:mod:`paramserver.config.sections`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TypeVar, get_type_hints

from paramserver.config.choices import Mode, ValueCodec
from paramserver.config.rules import CodecsSection, OptimSection
from paramserver.config.sections import (
    CheckpointSection,
    ConsistencySection,
    LaunchSection,
    LoopSection,
    ObserveSection,
    PublishSection,
    TablesSection,
)
from paramserver.optimconfig import OptimizerConfig

_Section = TypeVar("_Section")


@dataclass(frozen=True, kw_only=True)
class Sections:
    """A TrainConfig's values, one object per section: what each component is handed."""

    launch: LaunchSection
    consistency: ConsistencySection
    loop: LoopSection
    optim: OptimSection
    tables: TablesSection
    codecs: CodecsSection
    checkpoint: CheckpointSection
    observe: ObserveSection
    publish: PublishSection

    @classmethod
    def of(cls, config: object) -> Sections:
        """The sections of ``config`` (a TrainConfig: an object with every section's fields)."""
        kinds = get_type_hints(cls)
        return cls(**{name: section_of(config, kind) for name, kind in kinds.items()})


def section_of(config: object, kind: type[_Section]) -> _Section:
    """Section ``kind`` of ``config`` (a TrainConfig): its fields' values, nothing else."""
    fields = dataclasses.fields(kind)  # type: ignore[arg-type]
    return kind(**{f.name: getattr(config, f.name) for f in fields})


@dataclass(frozen=True, kw_only=True)
class ConsistencySettings:
    """What a server's coordinator needs: when to apply and answer, whom to wait for."""

    mode: Mode
    num_trainers: int
    ssp_bound: int | None  # calls a trainer may run ahead, prefetch counted; None unless ssp
    round_deadline: float | None
    min_contributors: int
    trainer_timeout: float
    stall_limit: float
    max_message_bytes: int
    checkpoint_dir: str | None

    @classmethod
    def of(
        cls,
        consistency: ConsistencySection,
        launch: LaunchSection,
        checkpoint: CheckpointSection,
    ) -> ConsistencySettings:
        return cls(
            mode=consistency.mode,
            num_trainers=launch.trainers,
            ssp_bound=consistency.servers_ssp_bound,
            round_deadline=consistency.round_deadline,
            min_contributors=consistency.min_contributors,
            trainer_timeout=consistency.trainer_timeout,
            stall_limit=consistency.stall_limit,
            max_message_bytes=launch.max_message_bytes,
            checkpoint_dir=checkpoint.checkpoint_dir,
        )


@dataclass(frozen=True, kw_only=True)
class ShardSettings:
    """What a server's shard needs: each parameter's update rule and pull codec."""

    dense_rule: OptimizerConfig
    table_rules: Mapping[str, OptimizerConfig]  # every table of the model
    table_pull_codecs: Mapping[str, ValueCodec]
    dense_pull_codec: ValueCodec
    cache_lag: int | None  # the lag trainers' caches are served with; None: they cache nothing

    @classmethod
    def of(
        cls,
        optim: OptimSection,
        codecs: CodecsSection,
        rows: TablesSection,
        tables: Collection[str],
    ) -> ShardSettings:
        """The settings of a shard of ``tables`` (every table of the model)."""
        return cls(
            dense_rule=optim.dense_optimizer(),
            table_rules={name: optim.table_optimizer_for(name) for name in tables},
            table_pull_codecs={name: codecs.codecs_for_table(name)[1] for name in tables},
            dense_pull_codec=codecs.dense_pull_codec,
            cache_lag=rows.served_cache_lag,
        )
