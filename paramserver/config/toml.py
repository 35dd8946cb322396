"""A job's TOML file (``--config``) read into TrainConfig keyword arguments.

Keys are TrainConfig field names, with ``_`` or ``-``, whatever their section; ``[tables.NAME]``
sections give one table its own optimizer and schedule (an OptimizerConfig's keys) and codecs
(``push_codec``, ``pull_codec``). Unknown keys are errors, so a typo never silently does
nothing; flags given with the file override it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from paramserver.config.rules import TableCodecs
from paramserver.config.train import RENAMED_FIELDS, config_fields
from paramserver.errors import ConfigError
from paramserver.optimconfig import OptimizerConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


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
