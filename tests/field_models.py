"""Models written the way recommendation libraries write them (numpy sizes, a table's weight
read by ``F.embedding_bag``, layers sharing a weight, ``self.to(device)``, values given from
numpy), with their data: shared by the tests of field models and of lookup discovery."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

NUM_ITEMS = np.int64(60)  # sizes as CTR libraries compute them: df[col].max() + 1
NUM_USERS = np.int32(25)
STEPS = 20


class SharedItemTable(nn.Module):
    """DIN-style: one item table read by a history bag (F.embedding_bag on its weight, with
    per-sample weights) and by the target item (the layer), numpy sizes, and a constructor
    that moves itself to its device."""

    def __init__(self) -> None:
        super().__init__()
        self.item = nn.Embedding(NUM_ITEMS, 8)
        self.user = nn.EmbeddingBag(NUM_USERS, 8, mode="sum")
        self.top = nn.Sequential(nn.Linear(24, 8), nn.ReLU(), nn.Linear(8, 1))
        self.to(torch.device("cpu"))

    def forward(
        self, history: Tensor, offsets: Tensor, weights: Tensor, target: Tensor, user: Tensor
    ) -> Tensor:
        seen = F.embedding_bag(
            history, self.item.weight, offsets, mode="sum", per_sample_weights=weights
        )
        x = torch.cat([seen, self.item(target), self.user(user)], dim=1)
        return self.top(x).squeeze(1)


def shared_item_batches(seed: int) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        lengths = torch.randint(1, 6, (8,), generator=g)
        history = torch.randint(0, int(NUM_ITEMS), (int(lengths.sum()),), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
        weights = torch.rand(history.numel(), generator=g)
        target = torch.randint(0, int(NUM_ITEMS), (8,), generator=g)
        user = torch.randint(0, int(NUM_USERS), (8, 2), generator=g)
        yield (history, offsets, weights, target, user), torch.randn(8, generator=g)


class TiedLayers(nn.Module):
    """Two layers sharing one weight (a padded history bag tied to the item embedding), a bag
    with include_last_offset, and a table given values from numpy (facebookresearch/dlrm's
    way)."""

    def __init__(self) -> None:
        super().__init__()
        self.item = nn.Embedding(NUM_ITEMS, 4)
        self.history = nn.EmbeddingBag(NUM_ITEMS, 4, mode="mean", padding_idx=0)
        self.history.weight = self.item.weight
        self.category = nn.EmbeddingBag(np.int64(12), 4, mode="sum", include_last_offset=True)
        bound = np.sqrt(1 / 12)
        values = np.random.uniform(-bound, bound, size=(12, 4)).astype(np.float32)
        self.category.weight.data = torch.tensor(values, requires_grad=True)
        self.top = nn.Linear(12, 1)

    def forward(
        self, history: Tensor, target: Tensor, categories: Tensor, offsets: Tensor
    ) -> Tensor:
        x = torch.cat(
            [self.history(history), self.item(target), self.category(categories, offsets)], dim=1
        )
        return self.top(x).squeeze(1)


def tied_layer_batches(seed: int) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        history = torch.randint(0, int(NUM_ITEMS), (6, 4), generator=g)
        history[:, 3] = 0  # padding
        target = torch.randint(1, int(NUM_ITEMS), (6,), generator=g)
        lengths = torch.randint(1, 4, (6,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        categories = torch.randint(0, 12, (int(lengths.sum()),), generator=g)
        yield (history, target, categories, offsets), torch.randn(6, generator=g)


def mse(output: Tensor, target: Tensor) -> Tensor:
    return ((output - target) ** 2).mean()
