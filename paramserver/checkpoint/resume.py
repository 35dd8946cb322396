"""Reading committed checkpoints back: which one a resumed job continues from, and a model's
plain state_dict assembled from its servers' saved shards.

Servers and trainers both resume from :func:`resume_from`; :func:`gather_saved` assembles a
model's state_dict in memory (``paramserver export`` streams it instead, see
:mod:`paramserver.checkpoint.export`). What a saved shard holds is written by
:func:`paramserver.store.snapshot.snapshot_store`: dense values by name, table rows by global
row id (fixed tables) or id (dynamic tables).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from torch import Tensor

from paramserver.checkpoint.store import (
    DENSE_PART,
    MANIFEST,
    Checkpoint,
    _checkpoint_dirs,
    load_latest,
)
from paramserver.config import TrainConfig
from paramserver.errors import CheckpointError, ConfigError
from paramserver.sharding import merge_rows
from paramserver.store.snapshot import Saved

log = logging.getLogger(__name__)


def check_fresh_start(config: TrainConfig) -> None:
    """Refuse a job that starts afresh (no ``--resume``) in a ``--checkpoint-dir`` holding a
    committed checkpoint: its commits could never become the newest (``LATEST`` never moves
    back), and it would train with no checkpoint at all. Cheap: manifests are not verified."""
    root = config.checkpoint_dir
    if config.resume or root is None or not Path(root).is_dir():
        return
    committed = [step for step, path in _checkpoint_dirs(Path(root)) if (path / MANIFEST).exists()]
    if committed:
        raise ConfigError(
            f"--checkpoint-dir {root} already holds checkpoints (the newest at step "
            f"{max(committed)}): pass --resume to continue that job, or give an empty directory"
        )


def resume_from(config: TrainConfig) -> Checkpoint | None:
    """The checkpoint ``--resume`` continues from; None if there is none yet (a job restarted
    by torchrun passes ``--resume`` every time, also before its first checkpoint)."""
    assert config.checkpoint_dir is not None
    found = load_latest(config.checkpoint_dir)
    if found is None:
        log.warning("--resume: no checkpoint in %s yet; starting afresh", config.checkpoint_dir)
        return None
    saved = found.meta
    if saved.get("trainers") != config.trainers or saved.get("mode") != config.mode:
        raise CheckpointError(
            f"--resume: {found.directory} was saved by a job with {saved.get('trainers')} "
            f"trainers in {saved.get('mode')} mode; this job has {config.trainers} in "
            f"{config.mode} mode (servers may differ, trainers and mode may not)"
        )
    return found


def saved_dense(found: Checkpoint) -> dict[str, Tensor]:
    """The dense values and optimizer state a checkpoint holds (``dense/NAME/value``,
    ``dense/NAME/state.SLOT``, ``dense/NAME/step``), saved under either ``--dense-sync``: the
    trainers' dense part, or each server's part (read whole, one at a time)."""
    names = [DENSE_PART] if DENSE_PART in found.part_names else [
        n for n in found.part_names if n.startswith("server-")
    ]  # fmt: skip
    dense: dict[str, Tensor] = {}
    for name in names:
        tensors, _ = found.read_part(name)
        dense.update({k: v for k, v in tensors.items() if k.startswith("dense/")})
        del tensors
    return dense


def gather_saved(saved: Iterable[Saved]) -> dict[str, Tensor]:
    """A plain state_dict of the model from saved shards: dense values, fixed tables whole,
    dynamic tables as ``NAME.ids`` (sorted) and ``NAME.weight``; held whole in memory."""
    state: dict[str, Tensor] = {}
    rows: dict[str, list[dict[str, Tensor]]] = {}
    dynamic: set[str] = set()
    for tensors, meta in saved:
        for name in meta["dense"]:
            state[name] = tensors[f"dense/{name}/value"]
        for name, table_meta in meta["tables"].items():
            prefix = f"table/{name}/"
            rows.setdefault(name, []).append(
                {"ids": tensors[prefix + "ids"], "value": tensors[prefix + "value"]}
            )
            if table_meta["dynamic"]:
                dynamic.add(name)
    for name, parts in rows.items():
        merged = merge_rows(parts)
        state[name] = merged["value"]  # a fixed table: rows 0..N-1 in order
        if name in dynamic:
            state[name.removesuffix("weight") + "ids"] = merged["ids"]
    return state
