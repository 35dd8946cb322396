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


class Feature:
    """A feature as CTR libraries declare one (torch-rechub's ``SparseFeature`` and
    ``SequenceFeature``): its table is made once and cached on the feature, so every model
    built from one feature list holds the same layer; ``shared_with`` names the feature whose
    table it reads."""

    def __init__(
        self, name: str, vocab: int, dim: int, shared_with: str | None = None, padding_idx=None
    ):
        self.name, self.vocab, self.dim = name, vocab, dim
        self.shared_with, self.padding_idx = shared_with, padding_idx

    def embedding_layer(self) -> nn.Embedding:
        if not hasattr(self, "embed"):
            self.embed = nn.Embedding(self.vocab, self.dim, padding_idx=self.padding_idx)
            nn.init.normal_(self.embed.weight, std=0.1)
        return self.embed


class Dice(nn.Module):
    """DIN's activation: a per-sample normalised gate with a learned slope below it."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.randn(1))

    def forward(self, x: Tensor) -> Tensor:
        centred = x - x.mean(dim=-1, keepdim=True)
        gate = torch.sigmoid(centred / (centred.pow(2).sum(dim=-1, keepdim=True) + 1e-3).sqrt())
        return gate * x + (1 - gate) * self.alpha * x


# Built once, as a library's example builds them: every model of this process shares the layers.
USER = Feature("user", int(NUM_USERS), 8)
ITEM = Feature("item", int(NUM_ITEMS), 8)
HISTORY = Feature("history", int(NUM_ITEMS), 8, shared_with="item", padding_idx=0)


class AttentionPooledHistory(nn.Module):
    """DIN as torch-rechub writes it: tables made by cached features (the history reads the
    item's table, padded with id 0 and masked), the history pooled by attention over the
    target item (an MLP with Dice), and an MLP with Dice on top."""

    def __init__(self, features: tuple[Feature, ...] = (USER, ITEM, HISTORY)) -> None:
        super().__init__()
        self.features = list(features)
        self.embed = nn.ModuleDict(
            {f.name: f.embedding_layer() for f in features if f.shared_with is None}
        )
        self.attention = nn.Sequential(nn.Linear(32, 16), Dice(), nn.Linear(16, 1))
        self.mlp = nn.Sequential(nn.Linear(24, 16), Dice(), nn.Linear(16, 1))

    def forward(self, user: Tensor, item: Tensor, history: Tensor) -> Tensor:
        mask = (history != HISTORY.padding_idx).float()
        seen = self.embed[HISTORY.shared_with or HISTORY.name](history)  # [batch, length, dim]
        target = self.embed[ITEM.name](item)
        expanded = target.unsqueeze(1).expand_as(seen)
        pair = torch.cat([expanded, seen, expanded - seen, expanded * seen], dim=-1)
        weights = self.attention(pair).squeeze(-1) * mask
        pooled = (weights.unsqueeze(-1) * seen).sum(dim=1)
        x = torch.cat([pooled, target, self.embed[USER.name](user)], dim=1)
        return self.mlp(x).squeeze(1)


def attention_pooled_batches(seed: int) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        user = torch.randint(0, int(NUM_USERS), (8,), generator=g)
        item = torch.randint(1, int(NUM_ITEMS), (8,), generator=g)
        history = torch.randint(1, int(NUM_ITEMS), (8, 5), generator=g)
        lengths = torch.randint(1, 6, (8, 1), generator=g)
        history = torch.where(torch.arange(5) < lengths, history, torch.zeros_like(history))
        yield (user, item, history), torch.randn(8, generator=g)


class BatchNormedFields(nn.Module):
    """DeepFM/DCN-style deep part: the fields' embeddings concatenated, batch-normed, then an
    MLP with batch norm between its layers (running statistics: buffers, not parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Embedding(NUM_USERS, 4)
        self.item = nn.Embedding(NUM_ITEMS, 4)
        self.mlp = nn.Sequential(
            nn.BatchNorm1d(8), nn.Linear(8, 8), nn.ReLU(), nn.BatchNorm1d(8), nn.Linear(8, 1)
        )

    def forward(self, user: Tensor, item: Tensor) -> Tensor:
        return self.mlp(torch.cat([self.user(user), self.item(item)], dim=1)).squeeze(1)


def batch_normed_batches(seed: int) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        user = torch.randint(0, int(NUM_USERS), (8,), generator=g)
        item = torch.randint(0, int(NUM_ITEMS), (8,), generator=g)
        yield (user, item), torch.randn(8, generator=g) + 1.0


def mse(output: Tensor, target: Tensor) -> Tensor:
    return ((output - target) ** 2).mean()
