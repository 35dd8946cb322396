"""A DLRM-style click model (Naumov et al., 2019): dense features through a bottom MLP, one
embedding per categorical feature, pairwise dot-product interactions, then a top MLP."""

from __future__ import annotations

from itertools import pairwise

import torch
from torch import Tensor, nn

from paramserver.embedding import DynamicEmbedding


def mlp(sizes: list[int], final_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(pairwise(sizes)):
        layers.append(nn.Linear(fan_in, fan_out))
        if i < len(sizes) - 2 or final_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """``forward(dense [B, num_dense] float, sparse [B, num_tables] int64) -> logits [B]``.

    With ``dynamic_tables`` the tables are :class:`~paramserver.DynamicEmbedding` (any int64
    id, rows created on first sight) and ``table_rows`` gives only their number.
    """

    def __init__(
        self,
        num_dense: int = 13,
        table_rows: list[int] | None = None,
        embedding_dim: int = 16,
        bottom: tuple[int, ...] = (64,),
        top: tuple[int, ...] = (64,),
        dynamic_tables: bool = False,
    ):
        super().__init__()
        table_rows = table_rows if table_rows is not None else [100_000] * 8
        self.bottom = mlp([num_dense, *bottom, embedding_dim], final_activation=True)
        tables: list[nn.Module] = []
        for rows in table_rows:
            if dynamic_tables:
                tables.append(DynamicEmbedding(embedding_dim, init_scale=0.05))
            else:
                table = nn.Embedding(rows, embedding_dim)
                nn.init.uniform_(table.weight, -0.05, 0.05)
                tables.append(table)
        self.embeddings = nn.ModuleList(tables)
        num_vectors = len(table_rows) + 1
        pairs = torch.triu_indices(num_vectors, num_vectors, offset=1)
        # Each pair (i < j) as its place in a flattened [vectors x vectors] matrix: one
        # index_select picks them (and its backward is an index_add), about half the time of
        # indexing with both rows and columns, and bitwise the same.
        self.pairs = pairs[0] * num_vectors + pairs[1]
        interactions = num_vectors * (num_vectors - 1) // 2
        self.top = mlp([embedding_dim + interactions, *top, 1], final_activation=False)

    def forward(self, dense: Tensor, sparse: Tensor) -> Tensor:
        bottom = self.bottom(dense)
        vectors = [bottom] + [table(sparse[:, i]) for i, table in enumerate(self.embeddings)]
        stacked = torch.stack(vectors, dim=1)  # [B, tables + 1, dim]
        dots = torch.bmm(stacked, stacked.transpose(1, 2)).flatten(1).index_select(1, self.pairs)
        return self.top(torch.cat([bottom, dots], dim=1)).squeeze(1)
