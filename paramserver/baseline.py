"""Single-process training in plain PyTorch: the reference paramserver is measured against.

The fastest plain-PyTorch way for models with large tables: embeddings produce sparse
gradients (``sparse=True``) and the optimizer updates only touched rows (SGD and Adagrad take
sparse gradients; Adam's tables use SparseAdam). Batches of all trainers are interleaved in
the order a sync job would see them.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from itertools import zip_longest
from typing import Any

import torch
from torch import Tensor, nn

from paramserver.config import OptimizerConfig, TrainConfig
from paramserver.embedding import DynamicEmbedding
from paramserver.errors import ConfigError
from paramserver.modelplan import EMBEDDINGS, initial_model
from paramserver.types import DataFn, LossFn, ModelFn, as_tuple


def make_optimizers(model: nn.Module, config: TrainConfig) -> list[torch.optim.Optimizer]:
    """The dense parameters' optimizer and one per table, as ``config`` sets them.

    Row-wise Adagrad has no torch.optim counterpart; plain Adagrad stands in for it here.
    """
    tables = {
        f"{name}.weight" if name else "weight": m
        for name, m in model.named_modules()
        if isinstance(m, EMBEDDINGS)
    }
    table_ids = {id(m.weight) for m in tables.values()}
    dense = [p for p in model.parameters() if id(p) not in table_ids]
    optimizers = [_optimizer(dense, config.dense_optimizer(), sparse=False)]
    for name, module in tables.items():
        module.sparse = True
        optimizers.append(
            _optimizer([module.weight], config.table_optimizer_for(name), sparse=True)
        )
    return optimizers


def _optimizer(params: Sequence[Tensor], c: OptimizerConfig, sparse: bool) -> torch.optim.Optimizer:
    if c.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=c.lr,
            momentum=c.momentum,
            dampening=c.dampening,
            nesterov=c.nesterov,
            weight_decay=c.weight_decay,
        )
    if c.name in ("adagrad", "rowwise_adagrad"):
        return torch.optim.Adagrad(
            params,
            lr=c.lr,
            lr_decay=c.lr_decay,
            weight_decay=c.weight_decay,
            initial_accumulator_value=c.initial_accumulator_value,
            eps=c.resolved_eps,
        )
    if sparse:
        if c.weight_decay:
            raise ConfigError("the single-process reference (SparseAdam) has no weight decay")
        return torch.optim.SparseAdam(params, lr=c.lr, betas=c.betas, eps=c.resolved_eps)
    return torch.optim.Adam(
        params, lr=c.lr, betas=c.betas, eps=c.resolved_eps, weight_decay=c.weight_decay
    )


def check_model(model: nn.Module) -> None:
    """ConfigError unless this reference can train ``model``: its tables must be fixed-size
    (a DynamicEmbedding's rows exist only on servers)."""
    if any(isinstance(m, DynamicEmbedding) for m in model.modules()):
        raise ConfigError(
            "the single-process reference trains fixed-size tables only, and this model has "
            "DynamicEmbedding tables"
        )


def train_single_process(
    model_fn: ModelFn, data_fn: DataFn, loss_fn: LossFn, config: TrainConfig
) -> tuple[nn.Module, dict[str, Any]]:
    """Train on every trainer's batches in one process; returns the model and throughput."""
    torch.set_num_threads(config.threads_per_process)
    model = initial_model(model_fn, config.seed)
    check_model(model)
    model.train()
    optimizers = make_optimizers(model, config)
    samples = steps = 0
    started = time.perf_counter()
    for _ in range(config.epochs):
        streams = [data_fn(t, config.trainers) for t in range(config.trainers)]
        for batches in zip_longest(*streams):
            for batch in batches:
                if batch is None:
                    continue
                inputs, target = batch
                for optimizer in optimizers:
                    optimizer.zero_grad(set_to_none=True)
                loss_fn(model(*as_tuple(inputs)), target).backward()
                with warnings.catch_warnings():  # torch warns at each sparse step: noise here
                    warnings.filterwarnings("ignore", message="Sparse invariant checks")
                    for optimizer in optimizers:
                        optimizer.step()
                samples += int(target.shape[0])
                steps += 1
            if config.steps is not None and steps >= config.steps * config.trainers:
                break
    seconds = time.perf_counter() - started
    for module in model.modules():
        if isinstance(module, EMBEDDINGS):
            module.sparse = False
    return model, {
        "samples": samples,
        "steps": steps,
        "seconds": seconds,
        "samples_per_s": samples / seconds if seconds else 0.0,
    }
