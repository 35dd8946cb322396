"""Small models and data shared by the tests."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

NUM_ROWS_A = 40
NUM_ROWS_B = 30


class TinyRecModel(nn.Module):
    """An embedding, a mean EmbeddingBag and a two-layer MLP: sparse and dense parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Embedding(NUM_ROWS_A, 4)
        self.items = nn.EmbeddingBag(NUM_ROWS_B, 4, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(8 + 3, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, user: Tensor, items: Tensor, dense: Tensor) -> Tensor:
        x = torch.cat([self.user(user), self.items(items), dense], dim=1)
        return self.mlp(x).squeeze(1)


def tiny_batches(
    trainer: int, num_batches: int = 20, batch: int = 6, seed: int = 0
) -> Iterator[tuple[tuple[Tensor, Tensor, Tensor], Tensor]]:
    g = torch.Generator().manual_seed(seed * 1000 + trainer)
    for _ in range(num_batches):
        user = torch.randint(0, NUM_ROWS_A, (batch,), generator=g)
        items = torch.randint(0, NUM_ROWS_B, (batch, 3), generator=g)
        dense = torch.randn(batch, 3, generator=g)
        target = torch.randn(batch, generator=g)
        yield (user, items, dense), target


def mse(output: Tensor, target: Tensor) -> Tensor:
    return ((output - target) ** 2).mean()


def nan_loss(output: Tensor, target: Tensor) -> Tensor:
    """A loss whose gradients are all NaN: servers must reject every push of it."""
    return (output * float("nan")).mean()
