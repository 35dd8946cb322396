"""Digests of the final states of small jobs: a refactoring that keeps behaviour keeps them.

Each job trains a small model (a fixed table, a dynamic table, an ``EmbeddingBag`` and dense
layers) on one machine with the threads launcher, in a setting whose result does not depend
on timing (sync rounds, or one trainer), and digests what it ends with: the gathered model's
``state_dict`` and, where it checkpoints, every tensor of its last checkpoint (rows with their
optimizer state). The jobs cover each update rule, fixed and dynamic tables, prefetch with own
updates, grouped steps, a row cache, lossy codecs, server pooling, a learning-rate schedule and
a resume from a checkpoint. The model, its batches and the update rules are small_models.py's,
whose rules the tests of each rule train under too (tests/factorization.py).

    .venv/bin/python benchmarks/state_digest.py --out before.json
    (change the code)
    .venv/bin/python benchmarks/state_digest.py --against before.json   # exit 1 on a difference
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from small_models import NUM_STEPS, RULES, Recommender, mse, recommender_batches
from torch import Tensor

import paramserver as ps


def digest_tensors(tensors: dict[str, Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits
            tensor = tensor.view(torch.int16)
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def checkpoint_tensors(directory: Path) -> dict[str, Tensor]:
    """Every tensor of every file of the newest checkpoint in ``directory``, by file and key."""
    found: dict[str, Tensor] = {}
    steps = sorted(p for p in directory.iterdir() if p.is_dir() and p.name.startswith("ckpt-"))
    newest = steps[-1]
    for path in sorted(newest.rglob("*.pt")):
        saved = torch.load(path, weights_only=True)
        for key, value in _flat(saved):
            # Trainers of the threads launcher share the process's torch generator: its
            # state when they save depends on how their threads interleaved.
            if not key.endswith("torch_rng"):
                found[f"{path.relative_to(newest)}/{key}"] = value
    return found


def _flat(value: Any, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
    if isinstance(value, Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _flat(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _flat(item, f"{prefix}[{index}]")


def run(dynamic_users: bool, rule: str, **options: Any) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as scratch:
        settings: dict[str, Any] = {
            "servers": 2, "trainers": 2, "mode": "sync", "launcher": "threads",
            "progress": False, "seed": 5, **RULES[rule], **options,
        }  # fmt: skip
        if settings.pop("checkpointed", False):  # stops two thirds in; resumed, ends
            settings.update(checkpoint_dir=scratch, checkpoint_every=NUM_STEPS // 3)
            settings["steps"] = NUM_STEPS * 2 // 3
        config = ps.TrainConfig(**settings)
        result = ps.train(lambda: Recommender(dynamic_users), recommender_batches, mse, config)
        assert result is not None and result.model is not None
        digests = {"model": digest_tensors(result.model.state_dict())}
        if config.checkpoint_dir:
            digests["checkpoint"] = digest_tensors(checkpoint_tensors(Path(scratch)))
            resumed = ps.TrainConfig(**{**settings, "resume": True, "steps": None})
            again = ps.train(lambda: Recommender(dynamic_users), recommender_batches, mse, resumed)
            assert again is not None and again.model is not None
            digests["resumed"] = digest_tensors(again.model.state_dict())
        return digests


JOBS: dict[str, Callable[[], dict[str, str]]] = {
    **{f"sync_fixed_{rule}": (lambda r=rule: run(False, r)) for rule in RULES},
    **{f"sync_dynamic_{rule}": (lambda r=rule: run(True, r)) for rule in RULES},
    "async_one_trainer_prefetch_adam": lambda: run(True, "adam", mode="async", trainers=1),
    "async_grouped_steps_adagrad": lambda: run(
        True, "adagrad", mode="async", trainers=1, steps_per_call=4
    ),
    "async_one_trainer_cache_rows": lambda: run(
        False, "adagrad", mode="async", trainers=1, cache_rows=16, cache_lag=1
    ),
    "sync_lossy_codecs": lambda: run(
        True, "sgd", dense_push_codec="fp16", table_push_codec="int8", table_pull_codec="fp16"
    ),
    "sync_server_pooling": lambda: run(False, "momentum", server_pooling=("history.weight",)),
    "sync_schedule": lambda: run(
        True, "adam", lr_warmup_steps=3, lr_decay="cosine", lr_decay_steps=NUM_STEPS
    ),
    "sync_checkpoint_resume": lambda: run(True, "rowwise_adagrad", checkpointed=True),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the digests here (JSON)")
    parser.add_argument("--against", help="digests to compare with: exit 1 on any difference")
    args = parser.parse_args()
    torch.set_num_threads(1)
    digests = {name: job() for name, job in JOBS.items()}
    text = json.dumps(digests, indent=2, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if not args.against:
        print(text)
        return 0
    expected = json.loads(Path(args.against).read_text())
    differing = sorted(
        name for name in expected.keys() | digests.keys() if expected.get(name) != digests.get(name)
    )
    for name in differing:
        print(f"differs: {name}: {expected.get(name)} != {digests.get(name)}")
    print(f"{len(digests) - len(differing)} of {len(expected)} jobs end bitwise the same")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
