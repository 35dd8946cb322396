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
from typing import Any

from torch import Tensor

from paramserver.checkpoint.manifest import parse_manifest, read_manifest_json
from paramserver.checkpoint.store import (
    DENSE_PART,
    Checkpoint,
    checkpoint_dir,
    committed_steps,
    load_latest,
)
from paramserver.config import TrainConfig
from paramserver.errors import CheckpointError, ConfigError
from paramserver.sharding import merge_rows
from paramserver.store.snapshot import Saved

log = logging.getLogger(__name__)


def check_checkpoint_dir(config: TrainConfig) -> None:
    """What the launcher refuses of ``--checkpoint-dir`` before any process starts (a
    ConfigError, exit status 2), reading only manifests (not verified: the job's processes do):

    - a job that starts afresh (no ``--resume``) where a checkpoint is committed: its commits
      could never become the newest (``LATEST`` never moves back), and it would train with no
      checkpoint at all;
    - ``--resume`` from a checkpoint of another job shape (see :func:`resume_problem`)."""
    root = config.checkpoint_dir
    if root is None or not Path(root).is_dir():
        return
    committed = committed_steps(root)
    if not committed:
        return
    if not config.resume:
        raise ConfigError(
            f"--checkpoint-dir {root} already holds checkpoints (the newest at step "
            f"{committed[-1]}): pass --resume to continue that job, or give an empty directory"
        )
    directory = checkpoint_dir(root, committed[-1])
    document, problem = read_manifest_json(directory)
    manifest = None if problem else parse_manifest(document)[0]
    if manifest is None:
        return  # the processes verify it, and say what is wrong, or take an older one
    problem = resume_problem(manifest.meta, config)
    if problem:
        raise ConfigError(f"--resume from {directory}: {problem}")


def resume_problem(saved: dict[str, Any], config: TrainConfig) -> str | None:
    """Why a checkpoint whose job metadata is ``saved`` cannot continue as ``config``'s job.

    A sync job continues bitwise, each trainer from its own data position and call: only from
    a sync checkpoint of as many trainers. An async or SSP job promises no replay, so it may
    continue any checkpoint on any trainer count (the data is split anew: see
    :func:`paramserver.trainer.loop.resume_trainer`). Servers may always differ."""
    saved_mode, saved_trainers = saved.get("mode"), saved.get("trainers")
    if config.mode == "sync" and (saved_mode, saved_trainers) != ("sync", config.trainers):
        return (
            f"saved by a job with {saved_trainers} trainers in {saved_mode} mode; this job has "
            f"{config.trainers} in sync mode: a sync job continues bitwise, each trainer from "
            f"its own saved data position, so only from a sync checkpoint of as many trainers "
            f"(resume it in async or ssp mode to change either)"
        )
    return None


def resume_from(config: TrainConfig) -> Checkpoint | None:
    """The checkpoint ``--resume`` continues from; None if there is none yet (a job restarted
    by torchrun passes ``--resume`` every time, also before its first checkpoint)."""
    assert config.checkpoint_dir is not None
    found = load_latest(config.checkpoint_dir)
    if found is None:
        log.warning("--resume: no checkpoint in %s yet; starting afresh", config.checkpoint_dir)
        return None
    problem = resume_problem(found.meta, config)
    if problem:
        raise CheckpointError(f"--resume: {found.directory} was {problem}")
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
