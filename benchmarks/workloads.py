"""The bench suite's two workloads, each a model, a training stream and a held-out set.

- :class:`ClickWorkload`: the sparse model. DLRM with 8 tables x ``rows`` x 32 on synthetic click
  logs with Zipf ids (:mod:`paramserver.data.synthetic`), batches of 1024.
- :class:`MLPWorkload`: a dense-only MLP (512 -> 2048 -> 2048 -> 2048 -> 1, 9.4M parameters) on
  Gaussian features whose labels a fixed random teacher network plants: a label is a Bernoulli
  draw of the teacher's sigmoid, so the teacher's own AUC is the ceiling a learner can reach.

A workload is a small frozen dataclass: it pickles cheaply to the processes that train on it,
and each process builds the data it needs once (the builders are cached per process). Batch
``b`` is a pure function of ``(seed, b)`` and trainer ``r`` of ``T`` takes batches
``r, r + T, ...``, so every system sees the same data whatever its process count.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from bench_core import DenseTable
from torch import Tensor, nn

from paramserver.data.synthetic import SyntheticClickLogs, SyntheticSpec
from paramserver.metrics import auc_of_scores
from paramserver.models.dlrm import DLRM, mlp

Inputs = Tensor | tuple[Tensor, ...]
Batch = tuple[Inputs, Tensor]


@dataclass(frozen=True, kw_only=True)
class Workload:
    """``train_batches`` is the stream's length over all trainers; ``lr`` is the learning rate
    every system trains this workload with (Adagrad everywhere)."""

    name: str
    batch_size: int
    train_batches: int
    lr: float
    seed: int = 0

    def model(self) -> nn.Module:
        raise NotImplementedError

    def naive_model(self) -> nn.Module:
        """The model as a textbook parameter server holds it: every parameter moved whole."""
        return self.model()

    def train_stream(self, trainer: int, num_trainers: int) -> Iterator[Batch]:
        raise NotImplementedError

    def held_out(self) -> list[Batch]:
        raise NotImplementedError

    def ceiling_auc(self) -> float:
        """The AUC of the labels' ground truth on the held-out set."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class ClickWorkload(Workload):
    rows: int
    num_tables: int = 8
    embedding_dim: int = 32

    def model(self) -> nn.Module:
        return DLRM(table_rows=[self.rows] * self.num_tables, embedding_dim=self.embedding_dim)

    def naive_model(self) -> nn.Module:
        model = self.model()
        model.embeddings = nn.ModuleList(
            DenseTable(self.rows, self.embedding_dim) for _ in range(self.num_tables)
        )
        return model

    def logs(self) -> SyntheticClickLogs:
        return click_logs(
            SyntheticSpec(
                num_tables=self.num_tables,
                rows_per_table=self.rows,
                batch_size=self.batch_size,
                train_batches=self.train_batches,
                seed=self.seed,
            )
        )

    def train_stream(self, trainer: int, num_trainers: int) -> Iterator[Batch]:
        return self.logs().train_batches(trainer, num_trainers)

    def held_out(self) -> list[Batch]:
        return [batch for batch, _ in self.logs().eval_batches()]

    def ceiling_auc(self) -> float:
        labels, logits = [], []
        for (_, label), truth in self.logs().eval_batches():
            labels.append(label)
            logits.append(truth)
        return auc_of_scores(torch.cat(logits).sigmoid(), torch.cat(labels))


@dataclass(frozen=True)
class TeacherSpec:
    features: int
    hidden: int
    batch_size: int
    train_batches: int
    eval_samples: int
    seed: int


class TeacherData:
    """Gaussian features labelled by a fixed random teacher, ``tanh`` with ``hidden`` units."""

    EVAL_SEED_OFFSET = 1 << 40  # held-out batches never share a seed with training batches
    SCALE = 4.0  # the teacher logits' spread: its own held-out AUC is about 0.94

    def __init__(self, spec: TeacherSpec):
        self.spec = spec
        g = torch.Generator().manual_seed(spec.seed)
        self.w_in = torch.randn(spec.features, spec.hidden, generator=g) * 2 / spec.features**0.5
        self.w_out = torch.randn(spec.hidden, generator=g) * self.SCALE / spec.hidden**0.5

    def batch(self, seed: int, size: int) -> tuple[Tensor, Tensor, Tensor]:
        """Features, labels and the teacher's logits."""
        g = torch.Generator().manual_seed(seed)
        features = torch.randn(size, self.spec.features, generator=g)
        logits = torch.tanh(features @ self.w_in) @ self.w_out
        return features, torch.bernoulli(torch.sigmoid(logits), generator=g), logits

    def train_batches(self, trainer: int, num_trainers: int) -> Iterator[Batch]:
        for index in range(trainer, self.spec.train_batches, num_trainers):
            features, labels, _ = self.batch(
                self.spec.seed * 7_919 + 1 + index, self.spec.batch_size
            )
            yield features, labels

    def eval_batches(self, batch_size: int = 4096) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        for index, start in enumerate(range(0, self.spec.eval_samples, batch_size)):
            size = min(batch_size, self.spec.eval_samples - start)
            yield self.batch(self.EVAL_SEED_OFFSET + self.spec.seed * 7_919 + index, size)


@dataclass(frozen=True, kw_only=True)
class MLPWorkload(Workload):
    features: int = 512
    hidden: tuple[int, ...] = (2048, 2048, 2048)
    teacher_hidden: int = 32
    eval_samples: int = 16_384

    def model(self) -> nn.Module:
        return nn.Sequential(
            mlp([self.features, *self.hidden, 1], final_activation=False), nn.Flatten(0)
        )

    def data(self) -> TeacherData:
        return teacher_data(
            TeacherSpec(
                self.features,
                self.teacher_hidden,
                self.batch_size,
                self.train_batches,
                self.eval_samples,
                self.seed,
            )
        )

    def train_stream(self, trainer: int, num_trainers: int) -> Iterator[Batch]:
        return self.data().train_batches(trainer, num_trainers)

    def held_out(self) -> list[Batch]:
        return [(features, labels) for features, labels, _ in self.data().eval_batches()]

    def ceiling_auc(self) -> float:
        batches = list(self.data().eval_batches())
        logits = torch.cat([logits for _, _, logits in batches])
        return auc_of_scores(logits.sigmoid(), torch.cat([labels for _, labels, _ in batches]))


@functools.lru_cache(maxsize=2)
def click_logs(spec: SyntheticSpec) -> SyntheticClickLogs:
    return SyntheticClickLogs(spec)


@functools.lru_cache(maxsize=2)
def teacher_data(spec: TeacherSpec) -> TeacherData:
    return TeacherData(spec)


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
