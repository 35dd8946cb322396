"""The models and data of ``bench_field`` (importable, so worker processes find them):
a DLRM of ``nn.EmbeddingBag`` tables written the way facebookresearch/dlrm writes its model
(not its code), and a tiny one-table model."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

TABLE_SIZES = (2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 3_000, 8_000, 40_000, 100_000)
DIM = 16
NUM_DENSE = 13


class BagDLRM(nn.Module):
    """Bottom MLP, one sum bag per table (ids and offsets per table; sparse gradients, as
    facebookresearch/dlrm makes its bags), pairwise dots, top MLP."""

    def __init__(self, sizes: tuple[int, ...] = TABLE_SIZES) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(NUM_DENSE, 64), nn.ReLU(), nn.Linear(64, DIM))
        tables = []
        for rows in np.array(sizes):  # numpy integers, as a DLRM computes its sizes
            table = nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True)
            bound = np.sqrt(1 / rows)
            values = np.random.uniform(-bound, bound, size=(rows, DIM)).astype(np.float32)
            table.weight.data = torch.tensor(values, requires_grad=True)
            tables.append(table)
        self.tables = nn.ModuleList(tables)
        vectors = len(sizes) + 1
        self.pairs = torch.triu_indices(vectors, vectors, offset=1)
        self.top = nn.Sequential(
            nn.Linear(DIM + vectors * (vectors - 1) // 2, 64), nn.ReLU(), nn.Linear(64, 1)
        )

    def forward(self, dense: Tensor, offsets: list[Tensor], ids: list[Tensor]) -> Tensor:
        x = self.bottom(dense)
        bags = [table(i, o) for table, i, o in zip(self.tables, ids, offsets, strict=True)]
        stacked = torch.stack([x, *bags], dim=1)
        dots = torch.bmm(stacked, stacked.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(1_000, DIM)
        self.out = nn.Linear(DIM, 1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(self.table(ids)).squeeze(1)


@dataclass(frozen=True)
class Workload:
    name: str
    batch_size: int
    steps: int

    def model(self) -> nn.Module:
        return Tiny() if self.name == "tiny" else BagDLRM()

    def batches(self, trainer: int, num_trainers: int) -> Iterator[tuple[Any, Tensor]]:
        g = torch.Generator().manual_seed(1_000 + trainer)
        size = self.batch_size
        for _ in range(self.steps):
            target = torch.randint(0, 2, (size,), generator=g).float()
            if self.name == "tiny":
                yield torch.randint(0, 1_000, (size,), generator=g), target
                continue
            dense = torch.randn(size, NUM_DENSE, generator=g)
            ids, offsets = [], []
            for rows in TABLE_SIZES:
                lengths = torch.randint(1, 11, (size,), generator=g)
                offsets.append(
                    torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
                )
                ids.append(torch.randint(0, rows, (int(lengths.sum()),), generator=g))
            yield (dense, offsets, ids), target

    def longer(self, factor: int) -> Workload:
        return Workload(self.name, self.batch_size, self.steps * factor)
