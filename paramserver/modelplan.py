"""What every process of a job derives the same way from the user's ``model_fn``: the seeded
model, its embedding tables and its shard plan.

Servers and trainers never exchange the model. Each calls :func:`seeded_model` with the job's
seed and gets the same initial values; each calls :func:`plan_of` on its build and gets the same
:class:`~paramserver.sharding.ShardPlan`, whose fingerprint they compare at start-up. Tables are
the model's ``nn.Embedding``, ``nn.EmbeddingBag`` and
:class:`~paramserver.embedding.DynamicEmbedding` modules, named by their weights' state_dict
names (``emb.0.weight``); every other parameter is dense.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

from paramserver.embedding import DynamicEmbedding
from paramserver.sharding import DenseSpec, ShardPlan, TableSpec
from paramserver.types import ModelFn

EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)  # torch's own embedding layers
SERVED = (nn.Embedding, nn.EmbeddingBag, DynamicEmbedding)  # every layer that becomes a table
Embedding = nn.Embedding | nn.EmbeddingBag | DynamicEmbedding


def seeded_model(model_fn: ModelFn, seed: int) -> nn.Module:
    """``model_fn()`` under fixed seeds: every process that calls this gets the same values."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn must return an nn.Module, got {type(model).__name__}")
    return model


def find_embeddings(model: nn.Module) -> dict[str, Embedding]:
    """The model's served embedding layers, by their weights' state_dict names."""
    found: dict[str, Embedding] = {}
    for name, module in model.named_modules():
        if isinstance(module, SERVED):
            found[f"{name}.weight" if name else "weight"] = module
    return found


def plan_of(model: nn.Module, num_servers: int) -> ShardPlan:
    """The shard plan of ``model``: its embedding weights become tables, the rest dense."""
    tables = find_embeddings(model)
    table_weights = {id(module.weight) for module in tables.values()}
    dense = [
        DenseSpec(name, tuple(p.shape), p.dtype)
        for name, p in model.named_parameters()
        if id(p) not in table_weights
    ]
    specs = [
        TableSpec(name, 0, m.embedding_dim, m.weight.dtype, dynamic=m.options)
        if isinstance(m, DynamicEmbedding)
        else TableSpec(name, m.num_embeddings, m.embedding_dim, m.weight.dtype)
        for name, m in tables.items()
    ]
    return ShardPlan(dense, specs, num_servers)
