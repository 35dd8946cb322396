"""The small models that the update-rule tests and the state digests train, their batches, and
the update rules they train under: one definition, so the digests that guard a redesign
(``state_digest.py``) train under the rules the tests check (tests/factorization.py).

Neutral ground: it imports neither the tests nor another benchmark, so the benchmarks import it
as ``small_models`` and the tests as ``benchmarks.small_models``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

import paramserver as ps

NUM_STEPS = 12
"""Batches each trainer trains on, per job."""

RULES: dict[str, dict[str, Any]] = {
    "sgd": {"optimizer": "sgd", "lr": 0.2},
    "momentum": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9},
    "adagrad": {"optimizer": "adagrad", "lr": 0.3},
    "rowwise_adagrad": {"table_optimizer": "rowwise_adagrad", "lr": 0.3},
    "adam": {"optimizer": "adam", "lr": 0.05},
}
"""Each update rule by name, as the ``TrainConfig`` settings that choose it."""


def users_table(dynamic: bool, ttl_steps: int) -> nn.Module:
    """40 users' vectors of 8, or a dynamic table admitting a user seen twice."""
    if dynamic:
        return ps.DynamicEmbedding(8, min_count=2, ttl_steps=ttl_steps)
    return nn.Embedding(40, 8)


def mse(out: Tensor, target: Tensor) -> Tensor:
    return ((out - target) ** 2).mean()


class Factorization(nn.Module):
    """Users' and items' vectors, an item bias, and a dense layer over their product."""

    def __init__(self, dynamic: bool = False) -> None:
        super().__init__()
        self.users = users_table(dynamic, ttl_steps=50)
        self.items = nn.Embedding(30, 8)
        self.bias = nn.Embedding(30, 1)
        self.out = nn.Linear(8, 1)

    def forward(self, users: Tensor, items: Tensor) -> Tensor:
        product = self.users(users) * self.items(items)
        return (self.out(product) + self.bias(items)).squeeze(-1)


def factorization_batches(rank: int) -> Iterator[tuple[tuple[Tensor, Tensor], Tensor]]:
    """Consecutive batches share most of their rows, as MovieLens's users do."""
    generator = torch.Generator().manual_seed(rank)
    for _ in range(NUM_STEPS):
        users = torch.randint(0, 12, (16,), generator=generator)
        items = torch.randint(0, 10, (16,), generator=generator)
        yield (users, items), torch.randn(16, generator=generator)


class Recommender(nn.Module):
    """Users (dynamic or fixed), items, a bag of each user's history, and a dense head: every
    kind of table the digests cover in one model."""

    def __init__(self, dynamic_users: bool) -> None:
        super().__init__()
        self.users = users_table(dynamic_users, ttl_steps=6)
        self.items = nn.Embedding(30, 8)
        self.history = nn.EmbeddingBag(30, 8, mode="sum")
        self.head = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, users: Tensor, items: Tensor, history: Tensor, offsets: Tensor) -> Tensor:
        user = self.users(users) + self.history(history, offsets)
        return self.head(torch.cat([user, self.items(items)], dim=1)).squeeze(-1)


def recommender_batches(rank: int, _trainers: int) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
    """Users, items, and a history of three items per user."""
    generator = torch.Generator().manual_seed(rank)
    for _ in range(NUM_STEPS):
        users = torch.randint(0, 14, (16,), generator=generator)
        items = torch.randint(0, 10, (16,), generator=generator)
        history = torch.randint(0, 30, (48,), generator=generator)
        offsets = torch.arange(0, 48, 3)
        yield (users, items, history, offsets), torch.randn(16, generator=generator)
