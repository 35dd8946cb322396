"""Synthetic click logs with a known answer.

Ids are Zipf-distributed (exponent ``zipf_exponent``; rank ``k`` drawn with probability
proportional to ``1 / (k + 1) ** s``, then mapped through a fixed random permutation so hot ids
are scattered like hashed ids). Labels come from a hidden ground-truth model: a linear term on
the dense features, a per-id bias for every table, and a dot product between the embeddings of
tables 0 and 1; the label is a Bernoulli draw of its sigmoid. The ground truth's own AUC on the
held-out set is the ceiling any learner can reach.

Batch ``b`` of the training stream is a pure function of ``(seed, b)``; trainer ``r`` of ``T``
takes batches ``r, r + T, r + 2T, ...``, so the data does not depend on the trainer count.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

Batch = tuple[tuple[Tensor, Tensor], Tensor]
EVAL_SEED_OFFSET = 1 << 40  # held-out batches never share a seed with training batches


@dataclass(frozen=True, kw_only=True)
class SyntheticSpec:
    num_dense: int = 13
    num_tables: int = 8
    rows_per_table: int = 100_000
    zipf_exponent: float = 1.1
    batch_size: int = 512
    train_batches: int = 3000
    eval_samples: int = 65_536
    seed: int = 0


class SyntheticClickLogs:
    def __init__(self, spec: SyntheticSpec):
        self.spec = spec
        g = torch.Generator().manual_seed(spec.seed)
        ranks = torch.arange(1, spec.rows_per_table + 1, dtype=torch.float64)
        weights = ranks.pow(-spec.zipf_exponent)
        self.cdf = (weights.cumsum(0) / weights.sum()).float()
        self.permutations = torch.stack(
            [torch.randperm(spec.rows_per_table, generator=g) for _ in range(spec.num_tables)]
        )
        self.dense_weight = torch.randn(spec.num_dense, generator=g) * 0.5
        self.id_bias = torch.randn(spec.num_tables, spec.rows_per_table, generator=g) * 0.8
        self.pair_embeddings = torch.randn(2, spec.rows_per_table, 4, generator=g) * 0.6
        self.bias = -1.0

    def _batch(self, seed: int, size: int) -> tuple[Tensor, Tensor, Tensor]:
        """Features, labels and the ground truth's logits for one batch."""
        s = self.spec
        g = torch.Generator().manual_seed(seed)
        dense = torch.randn(size, s.num_dense, generator=g)
        uniform = torch.rand(size, s.num_tables, generator=g)
        zipf_rank = torch.searchsorted(self.cdf, uniform).clamp_(max=s.rows_per_table - 1)
        sparse = self.permutations[torch.arange(s.num_tables), zipf_rank]  # [size, tables]
        logits = dense @ self.dense_weight + self.bias
        logits = logits + self.id_bias[torch.arange(s.num_tables), sparse].sum(1)
        pair = self.pair_embeddings[0, sparse[:, 0]] * self.pair_embeddings[1, sparse[:, 1]]
        logits = logits + pair.sum(1)
        labels = torch.bernoulli(torch.sigmoid(logits), generator=g)
        return dense, sparse, torch.stack([labels, logits])

    def train_batches(self, trainer: int, num_trainers: int) -> Iterator[Batch]:
        for index in range(trainer, self.spec.train_batches, num_trainers):
            dense, sparse, label_logit = self._batch(
                self.spec.seed * 7_919 + 1 + index, self.spec.batch_size
            )
            yield (dense, sparse), label_logit[0]

    def eval_batches(self, batch_size: int = 8192) -> Iterator[tuple[Batch, Tensor]]:
        """Held-out batches with the ground truth's logits (for the ceiling AUC)."""
        remaining = self.spec.eval_samples
        index = 0
        while remaining > 0:
            size = min(batch_size, remaining)
            dense, sparse, label_logit = self._batch(
                EVAL_SEED_OFFSET + self.spec.seed * 7_919 + index, size
            )
            yield ((dense, sparse), label_logit[0]), label_logit[1]
            remaining -= size
            index += 1
