"""Synthetic click logs with a known answer, in memory that does not grow with the tables.

Ids are Zipf-distributed (exponent ``zipf_exponent``; rank ``k`` drawn with probability
proportional to ``1 / (k + 1) ** s``, then mapped through a fixed random permutation so hot ids
are scattered like hashed ids). Labels come from a hidden ground-truth model: a linear term on
the dense features, a per-id bias for every table (``N(0, 0.8²)``), and a dot product between
the embeddings of tables 0 and 1 (4 values per id, each ``N(0, 0.6²)``); the label is a
Bernoulli draw of its sigmoid. The ground truth's own AUC on the held-out set is the ceiling any
learner can reach.

Nothing is stored per row, so a trainer (and the launcher) hold the same few bytes at 1k rows as
at 25M rows x 8 tables (where a table of biases, pair vectors and a permutation per row took
about 3.4 GB). Each per-row quantity is computed from a hash of the id when a batch needs it:

- the rank is drawn by Hörmann and Derflinger's rejection-inversion (exact, no CDF table;
  :class:`ZipfRanks`);
- the permutation is a keyed Feistel network on ``[0, 2**bits)``, cycle-walked back into
  ``[0, rows)`` (:func:`hashed_permutation`);
- biases and pair vectors are Box-Muller normals of two uniforms hashed from the id and a key
  per table and component (:func:`hashed_normal`).

Batch ``b`` of the training stream is a pure function of ``(seed, b)``; trainer ``r`` of ``T``
takes batches ``r, r + T, r + 2T, ...``, so the data does not depend on the trainer count.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from paramserver.hashing import mix64_array

Batch = tuple[tuple[Tensor, Tensor], Tensor]
EVAL_SEED_OFFSET = 1 << 40  # held-out batches never share a seed with training batches
ID_BIAS_STD = 0.8
PAIR_STD = 0.6
PAIR_DIM = 4
FEISTEL_ROUNDS = 4  # Luby-Rackoff: four rounds of a pseudorandom function give a strong PRP
_UNIT = 2.0**-53  # one step of a 53-bit uniform
# Which per-row quantity a key is for: a key is hashed from (seed, kind, table, component).
_PERMUTATION, _ID_BIAS, _PAIR = 1, 2, 3


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
    """The click logs of ``spec``. Holds O(1) memory in ``rows_per_table``; batches are drawn
    on the calling thread (no state changes, so threads may draw concurrently)."""

    def __init__(self, spec: SyntheticSpec):
        self.spec = spec
        g = torch.Generator().manual_seed(spec.seed)
        self.ranks = ZipfRanks(spec.rows_per_table, spec.zipf_exponent)
        tables = range(spec.num_tables)
        rounds = range(FEISTEL_ROUNDS)
        self.permutation_keys = keys_of(spec.seed, _PERMUTATION, rounds, tables)  # [rounds, T]
        self.id_bias_keys = keys_of(spec.seed, _ID_BIAS, tables)  # [T]
        self.pair_keys = keys_of(spec.seed, _PAIR, range(2), range(PAIR_DIM))  # [2, PAIR_DIM]
        self.dense_weight = torch.randn(spec.num_dense, generator=g) * 0.5
        self.bias = -1.0

    def _batch(self, seed: int, size: int) -> tuple[Tensor, Tensor, Tensor]:
        """Features, labels and the ground truth's logits for one batch."""
        s = self.spec
        g = torch.Generator().manual_seed(seed)
        dense = torch.randn(size, s.num_dense, generator=g)
        zipf_rank = self.ranks.sample(size * s.num_tables, g).view(size, s.num_tables)
        ids = hashed_permutation(zipf_rank.numpy(), s.rows_per_table, self.permutation_keys)
        first, second = self.pair_vectors(ids[:, 0], ids[:, 1])
        logits = dense @ self.dense_weight + self.bias + self.id_bias(ids).sum(1)
        logits = logits + (first * second).sum(1)
        labels = torch.bernoulli(torch.sigmoid(logits), generator=g)
        return dense, torch.from_numpy(ids), torch.stack([labels, logits])

    def id_bias(self, ids: np.ndarray) -> Tensor:
        """The ground truth's bias of each id, ``ids`` being ``[..., num_tables]`` (one column
        per table): ``N(0, 0.8²)``, independent across ids and tables."""
        return ID_BIAS_STD * hashed_normal(ids, self.id_bias_keys)

    def pair_vectors(self, table0_ids: np.ndarray, table1_ids: np.ndarray) -> tuple[Tensor, Tensor]:
        """The ground truth's embeddings (``[..., 4]``, each value ``N(0, 0.6²)``) of ids of
        tables 0 and 1, whose dot product enters the logit."""
        first = hashed_normal(table0_ids[..., None], self.pair_keys[0])
        second = hashed_normal(table1_ids[..., None], self.pair_keys[1])
        return PAIR_STD * first, PAIR_STD * second

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


class ZipfRanks:
    """Ranks ``k`` in ``[0, n)`` drawn with probability proportional to ``1 / (k + 1) ** s``.

    Rejection-inversion (W. Hörmann and G. Derflinger, "Rejection-inversion to generate variates
    from monotone discrete distributions", 1996; as in Apache Commons RNG): invert the integral
    of the continuous hat ``x ** -s`` and accept the rounded value under a test that makes the
    draw exact. Needs no table, accepts more than 90% of proposals for every ``s > 0``, and
    redraws only the rejected ones, so a batch takes a few vectorised passes.
    """

    def __init__(self, n: int, exponent: float):
        if n < 1 or not exponent > 0:
            raise ValueError(f"Zipf ranks need n >= 1 and exponent > 0, got {n} and {exponent}")
        self.n = n
        self.exponent = exponent
        self._h_x1 = self._h_integral(np.array([1.5])).item() - 1.0
        self._h_n = self._h_integral(np.array([n + 0.5])).item()
        two = np.array([2.0])
        self._s = 2.0 - self._h_integral_inverse(self._h_integral(two + 0.5) - self._h(two)).item()

    def sample(self, count: int, generator: torch.Generator) -> Tensor:
        """``count`` int64 ranks, with uniforms drawn from ``generator``: a pure function of its
        state."""
        ranks = np.empty(count, dtype=np.int64)
        pending = np.arange(count)
        while pending.size > 0:
            unit = torch.rand(pending.size, generator=generator, dtype=torch.float64).numpy()
            u = self._h_n + unit * (self._h_x1 - self._h_n)
            x = self._h_integral_inverse(u)
            k = np.clip(np.floor(x + 0.5), 1, self.n)
            accepted = (k - x <= self._s) | (u >= self._h_integral(k + 0.5) - self._h(k))
            ranks[pending[accepted]] = k[accepted].astype(np.int64) - 1
            pending = pending[~accepted]
        return torch.from_numpy(ranks)

    def _h(self, x: np.ndarray) -> np.ndarray:
        """The hat: ``x ** -s``."""
        return np.power(x, -self.exponent)

    def _h_integral(self, x: np.ndarray) -> np.ndarray:
        """An antiderivative of the hat: ``(x ** (1 - s) - 1) / (1 - s)``, ``log(x)`` at 1."""
        log_x = np.log(x)
        return _over(np.expm1, log_x * (1.0 - self.exponent)) * log_x

    def _h_integral_inverse(self, y: np.ndarray) -> np.ndarray:
        t = np.maximum(y * (1.0 - self.exponent), -1.0)
        return np.exp(_over(np.log1p, t) * y)


def _over(f: np.ufunc, t: np.ndarray) -> np.ndarray:
    """``f(t) / t`` for ``f`` = expm1 or log1p, continued by its limit 1 at ``t = 0``
    (both are accurate near 0, so only 0 itself needs the limit)."""
    ratio = np.ones_like(t)
    nonzero = t != 0
    ratio[nonzero] = f(t[nonzero]) / t[nonzero]
    return ratio


def keys_of(seed: int, kind: int, *axes: range) -> np.ndarray:
    """A hashed int64 key per cell of the grid ``axes`` (rounds x tables, say) for the per-row
    quantity ``kind``: distinct seeds, kinds and cells give unrelated keys."""
    grid = np.stack(np.meshgrid(*[np.arange(a.start, a.stop) for a in axes], indexing="ij"))
    key = mix64_array(mix64_array(np.full(grid.shape[1:], seed, dtype=np.int64)) ^ kind)
    for coordinate in grid:
        key = mix64_array(key ^ coordinate)
    return key


def hashed_permutation(values: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    """A keyed bijection of ``[0, n)`` applied to ``values`` (int64, each in ``[0, n)``).

    ``keys`` is ``[rounds, ...]``, its other dimensions broadcast with ``values`` as trailing
    ones (``[rounds, tables]`` for ``[batch, tables]`` values: a permutation per table).
    A Feistel network permutes ``[0, 2**bits)``, the smallest power of two of at least
    ``max(n, 4)``; a value it maps to ``n`` or beyond is mapped again until it lands inside
    (cycle-walking, fewer than two passes on average), which keeps a bijection of ``[0, n)``.
    """
    bits = max(2, (n - 1).bit_length())
    shape = np.broadcast_shapes(values.shape, keys.shape[1:])
    keys = keys.reshape(keys.shape[:1] + (1,) * (len(shape) + 1 - keys.ndim) + keys.shape[1:])
    keys = np.broadcast_to(keys, keys.shape[:1] + shape)
    out = _feistel(np.broadcast_to(values, shape).astype(np.int64), keys, bits)
    outside = out >= n
    while outside.any():
        out[outside] = _feistel(out[outside], keys[:, outside], bits)
        outside = out >= n
    return out


def _feistel(x: np.ndarray, keys: np.ndarray, bits: int) -> np.ndarray:
    """A bijection of ``[0, 2**bits)``: each round xors a hash of one half into the other."""
    low_bits = bits // 2
    masks = ((1 << (bits - low_bits)) - 1, (1 << low_bits) - 1)
    halves = [x >> low_bits, x & masks[1]]
    for round_index, key in enumerate(keys):
        changed = round_index % 2
        halves[changed] = halves[changed] ^ (
            mix64_array(halves[1 - changed] ^ key) & masks[changed]
        )
    return (halves[0] << low_bits) | halves[1]


def hashed_normal(ids: np.ndarray, keys: np.ndarray) -> Tensor:
    """A standard normal per (id, key), float32, shaped like ``ids`` broadcast with ``keys``.

    Box-Muller on two 53-bit uniforms hashed from the id and the key: a pure function of both,
    the same in every process.
    """
    first = mix64_array(ids ^ keys)
    second = mix64_array(first)
    u1 = (_top53(first) + 1.0) * _UNIT  # in (0, 1]: its log is finite
    u2 = _top53(second) * _UNIT
    normal = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)
    return torch.from_numpy(normal.astype(np.float32))


def _top53(h: np.ndarray) -> np.ndarray:
    """The top 53 bits of int64 hashes, as float64 in ``[0, 2**53)``."""
    return ((h >> 11) & ((1 << 53) - 1)).astype(np.float64)
