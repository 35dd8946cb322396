"""Job configuration: :class:`TrainConfig`, made of frozen section dataclasses whose field docs
become ``--help``, validated once.

:class:`TrainConfig` mirrors the ``paramserver train`` flags one to one (``lr`` is ``--lr``,
``rpc_threads`` is ``--rpc-threads``); a TOML file given with ``--config`` supplies the same
keys, and flags override it. Errors name the flag to change. Each field is defined in the
section that the component reading it is handed:

- ``choices.py``: the choices (``mode``, ``dense_sync``, ``launcher``, the codecs) as ``Literal``
  types, with their values;
- ``sections.py``: launch, consistency, loop, tables, checkpoint and observe sections;
- ``rules.py``: the update rules and schedules, and the codecs (both also per table);
- ``views.py``: the sections of a config (``Sections``), and what a server's coordinator and
  shard are built from, derived from sections;
- ``checks.py``: the validation; ``train.py``: TrainConfig itself; ``toml.py``: the file.

An update rule's own settings (optimizer, hyper-parameters, schedule) are
:class:`paramserver.optimconfig.OptimizerConfig`, which the optim section makes for the dense
parameters and each table.
"""

from paramserver.config.choices import (
    DENSE_SYNCS,
    GRADIENT_CODECS,
    LAUNCHERS,
    MODES,
    PUBLISH_CODECS,
    VALUE_CODECS,
    DenseSync,
    GradientCodec,
    Launcher,
    Mode,
    PublishCodec,
    ValueCodec,
    choices_of,
    type_parts,
)
from paramserver.config.rules import CodecsSection, OptimSection, TableCodecs
from paramserver.config.sections import (
    CALLS_PER_MESSAGE,
    STALL_TIMEOUT_FACTOR,
    CheckpointSection,
    ConsistencySection,
    LaunchSection,
    LoopSection,
    ObserveSection,
    PublishSection,
    TablesSection,
)
from paramserver.config.toml import read_toml
from paramserver.config.train import RENAMED_FIELDS, TrainConfig, config_fields
from paramserver.config.views import ConsistencySettings, Sections, ShardSettings, section_of

__all__ = [
    "CALLS_PER_MESSAGE",
    "DENSE_SYNCS",
    "GRADIENT_CODECS",
    "LAUNCHERS",
    "MODES",
    "PUBLISH_CODECS",
    "RENAMED_FIELDS",
    "STALL_TIMEOUT_FACTOR",
    "VALUE_CODECS",
    "CheckpointSection",
    "CodecsSection",
    "ConsistencySection",
    "ConsistencySettings",
    "DenseSync",
    "GradientCodec",
    "LaunchSection",
    "Launcher",
    "LoopSection",
    "Mode",
    "ObserveSection",
    "OptimSection",
    "PublishCodec",
    "PublishSection",
    "Sections",
    "ShardSettings",
    "TableCodecs",
    "TablesSection",
    "TrainConfig",
    "ValueCodec",
    "choices_of",
    "config_fields",
    "read_toml",
    "section_of",
    "type_parts",
]
