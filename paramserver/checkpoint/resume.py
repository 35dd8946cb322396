"""Reading committed checkpoints back: which one a resumed job continues from, and a model's
plain state_dict assembled from its servers' saved shards.

Servers and trainers both resume from :func:`resume_from`; :func:`gather_saved` assembles a
model's state_dict in memory (``paramserver export`` streams it instead, see
:mod:`paramserver.checkpoint.export`). What a saved shard holds is written by
:func:`paramserver.store.snapshot.snapshot_store`: dense values by name, table rows by global
row id (fixed tables) or id (dynamic tables).

A job's final checkpoint holds each trainer's *end* as its part: the steps and samples it had
done and its RNG states where its loop ended, so a resume with a larger budget (more data,
epochs or steps) trains on from there as the longer job would have. Where a trainer ends is
known only to it, and the final step only once every trainer has left, so each trainer stages
its end (:func:`stage_trainer_end`, under :data:`TRAINER_ENDS`) before its last call, and the
chief, which sees that call's report, writes the ends into the final checkpoint
(:func:`trainer_ends`).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from paramserver.checkpoint.manifest import parse_manifest, read_manifest_json
from paramserver.checkpoint.store import (
    DENSE_PART,
    Checkpoint,
    Part,
    checkpoint_dir,
    committed_steps,
    load_latest,
    write_part,
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


TRAINER_ENDS = "trainer-ends"
"""The directory under ``--checkpoint-dir`` where trainers stage their ends for the final
checkpoint (see the module doc); emptied once it is committed or given up."""


def stage_trainer_end(
    root: str, trainer: int, tensors: Mapping[str, Tensor], meta: Mapping[str, Any]
) -> None:
    """Trainer ``trainer``'s end, before its last call: its RNG states (``tensors`` and
    ``meta``, with ``steps_done`` and ``samples``), atomically and durably."""
    write_part(Path(root) / TRAINER_ENDS, f"trainer-{trainer}", tensors, meta)


def trainer_ends(root: str, step: int, expected: Mapping[int, tuple[int, int]]) -> list[Part]:
    """Chief, once every trainer has left: the staged ends of the trainers ``expected`` names
    (with the steps and samples each one's last report says it ended at), written into
    checkpoint ``step`` as their parts. A staged end that says otherwise was left by an
    earlier run and is not taken: that trainer then has no part, as one that had left."""
    staged = Path(root) / TRAINER_ENDS
    parts = []
    for trainer, (steps, samples) in sorted(expected.items()):
        name = f"trainer-{trainer}"
        try:
            meta = json.loads((staged / f"{name}.json").read_text())
            tensors = torch.load(staged / f"{name}.pt", weights_only=True)
        except FileNotFoundError:
            continue
        if (meta.get("steps_done"), meta.get("samples")) != (steps, samples):
            log.warning("%s: %s is an earlier run's end; not taken", staged, name)
            continue
        meta["step"] = step
        parts.append(write_part(checkpoint_dir(root, step), name, tensors, meta))
    return parts


def discard_trainer_ends(root: str) -> None:
    """Remove what trainers staged, once the final checkpoint is committed or not needed."""
    shutil.rmtree(Path(root) / TRAINER_ENDS, ignore_errors=True)


def resume_point(root: str | None) -> dict[str, Any] | None:
    """Where a job resumed from ``root`` now would begin, as a summary's ``resumed_from``
    says it: the newest committed checkpoint's step and each trainer's steps and samples by
    then (0 for one without a part: it had left). Read from the manifest and the trainers'
    metadata, unverified (the processes verify it); None without a readable checkpoint."""
    if root is None or not Path(root).is_dir():
        return None
    committed = committed_steps(root)
    if not committed:
        return None
    directory = checkpoint_dir(root, committed[-1])
    document, problem = read_manifest_json(directory)
    manifest = None if problem else parse_manifest(document)[0]
    if manifest is None:
        return None
    ends = dict(manifest.meta.get("stream_ends") or {})
    for name in manifest.parts:
        if name.startswith("trainer-"):
            try:
                ends[name.removeprefix("trainer-")] = json.loads(
                    (directory / f"{name}.json").read_text()
                )
            except (OSError, ValueError):
                return None
    trainers = range(int(manifest.meta.get("trainers", len(ends))))
    done = [ends.get(str(t), {}) for t in trainers]
    return {
        "checkpoint_step": manifest.step,
        "trainer_steps": [int(end.get("steps_done", 0)) for end in done],
        "samples": sum(int(end.get("samples", 0)) for end in done),
    }
