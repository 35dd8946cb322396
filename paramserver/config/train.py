"""TrainConfig: the job's settings, the union of its sections, validated once.

A user writes one flat ``TrainConfig(lr=0.1, mode="sync")``, a flag or a TOML key per field;
each field is defined in its section (:mod:`paramserver.config.sections`,
:mod:`paramserver.config.rules`), which TrainConfig takes as its bases, so ``config.lr``,
``config.replace(...)`` and ``dataclasses.fields(TrainConfig)`` are as flat as the flags.
Components never take it whole: each is handed its section (``config.sections.optim``), or a
view derived from several in :mod:`paramserver.config.views`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from paramserver.config.checks import check
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
from paramserver.config.views import ConsistencySettings, Sections, ShardSettings
from paramserver.errors import ConfigError
from paramserver.optimconfig import refuse_numeric_lr_decay


# A dataclass takes its bases' fields last base first: the flags appear in --help (and
# dataclasses.fields(TrainConfig) lists them) from LaunchSection's to PublishSection's.
@dataclass(frozen=True, kw_only=True)
class TrainConfig(
    PublishSection,
    ObserveSection,
    CheckpointSection,
    CodecsSection,
    TablesSection,
    OptimSection,
    LoopSection,
    ConsistencySection,
    LaunchSection,
):
    """Everything a job needs besides the model, the data and the loss."""

    def __post_init__(self) -> None:
        if isinstance(self.server_pooling, str | list):  # from a flag or a TOML array
            names = self.server_pooling
            names = names.split(",") if isinstance(names, str) else names
            object.__setattr__(self, "server_pooling", tuple(n for n in names if n))
        if not all(isinstance(n, str) for n in self.server_pooling):
            raise ConfigError("--server-pooling takes table names")
        refuse_numeric_lr_decay(self.lr_decay)
        check(self.sections)

    @functools.cached_property  # made once (a frozen dataclass keeps it in its __dict__)
    def sections(self) -> Sections:
        """The job's settings by section, for the components that read them."""
        return Sections.of(self)

    @property
    def consistency(self) -> ConsistencySettings:
        """What a server's coordinator needs: when to apply and answer, whom to wait for."""
        s = self.sections
        return ConsistencySettings.of(s.consistency, s.launch, s.checkpoint)

    def shard_settings(self, tables: Collection[str]) -> ShardSettings:
        """What a server's shard needs: each parameter's update rule and pull codec."""
        s = self.sections
        return ShardSettings.of(s.optim, s.codecs, s.tables, tables)

    @property
    def checkpoint_job(self) -> dict[str, Any]:
        """What a checkpoint records of the job that saved it (a resume checks it)."""
        return {"servers": self.servers, "trainers": self.trainers, "mode": self.mode}

    def check_tables(self, tables: Collection[str]) -> None:
        """Fail if a per-table option names a table the model does not have."""
        named = set(self.table_optimizers) | set(self.server_pooling) | set(self.table_codecs)
        unknown = sorted(named - set(tables))
        if unknown:
            raise ConfigError(
                f"the job names tables {unknown}, which the model does not have; its tables are "
                f"{sorted(tables)}"
            )

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


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
