"""A small factorization model and its batches, trained under each update rule: the
shared ground of the tests of prefetch with own updates and of grouped steps."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

import paramserver as ps

NUM_STEPS = 12
RULES = {
    "sgd": {"optimizer": "sgd", "lr": 0.2},
    "momentum": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9},
    "adagrad": {"optimizer": "adagrad", "lr": 0.3},
    "rowwise_adagrad": {"table_optimizer": "rowwise_adagrad", "lr": 0.3},
    "adam": {"optimizer": "adam", "lr": 0.05},
}


class Factorization(nn.Module):
    """Users' and items' vectors, an item bias, and a dense layer over their product."""

    def __init__(self, dynamic: bool = False) -> None:
        super().__init__()
        self.users = (
            ps.DynamicEmbedding(8, min_count=2, ttl_steps=50) if dynamic else nn.Embedding(40, 8)
        )
        self.items = nn.Embedding(30, 8)
        self.bias = nn.Embedding(30, 1)
        self.out = nn.Linear(8, 1)

    def forward(self, users: Tensor, items: Tensor) -> Tensor:
        product = self.users(users) * self.items(items)
        return (self.out(product) + self.bias(items)).squeeze(-1)


def batches(rank: int) -> Iterator[tuple[tuple[Tensor, Tensor], Tensor]]:
    """Consecutive batches share most of their rows, as MovieLens's users do."""
    generator = torch.Generator().manual_seed(rank)
    for _ in range(NUM_STEPS):
        users = torch.randint(0, 12, (16,), generator=generator)
        items = torch.randint(0, 10, (16,), generator=generator)
        yield (users, items), torch.randn(16, generator=generator)


def train(rule: str, dynamic: bool = False, **options: Any) -> dict[str, Tensor]:
    config = ps.TrainConfig(
        servers=2, trainers=1, mode="async", launcher="threads", progress=False,
        seed=3, **RULES[rule], **options,
    )  # fmt: skip
    result = ps.train(
        lambda: Factorization(dynamic),
        lambda rank, _: batches(rank),
        lambda out, target: ((out - target) ** 2).mean(),
        config,
    )
    assert result is not None and result.model is not None
    return result.model.state_dict()
