"""``DynamicEmbedding``: an embedding table keyed by arbitrary int64 ids (hashed features).

Put it in a model where ``nn.Embedding`` (``mode=None``) or ``nn.EmbeddingBag`` (``mode="sum"``,
``"mean"`` or ``"max"``) would go when ids are 64-bit hashes rather than a fixed vocabulary.
Under paramserver it becomes a dynamic table sharded over the servers by hash bucket: a row is
created the first time an admitted id is trained on (initialized by a seeded rule, so a run is
reproducible), and rows can expire (``ttl_steps``) or be evicted least-recently-used above
``capacity`` rows per server. See :mod:`paramserver.store.dynamic` for the exact rules.

Outside paramserver (the trained ``result.model``, or a model loaded from its ``state_dict``),
the module holds the rows it was given: ``ids`` (sorted) and ``weight`` (one row per id). An id
it does not hold reads as the default vector; nothing is created. Its state_dict is plain
tensors (``ids``, ``weight``) and loads with any number of rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

BAG_MODES = ("sum", "mean", "max")


@dataclass(frozen=True, kw_only=True)
class DynamicOptions:
    """How a dynamic table creates, admits and evicts rows: a :class:`DynamicEmbedding`'s
    options (documented there), which its table's spec carries to the servers
    (:class:`paramserver.sharding.TableSpec`)."""

    min_count: int = 1
    ttl_steps: int | None = None
    capacity: int | None = None  # rows per server
    init_scale: float = 0.01
    default_value: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {self.min_count}")
        if self.ttl_steps is not None and self.ttl_steps < 1:
            raise ValueError(f"ttl_steps must be >= 1, got {self.ttl_steps}")
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if self.min_count > 1 and self.ttl_steps is None:
            raise ValueError(
                "min_count > 1 needs ttl_steps, so counters of ids never admitted "
                "expire instead of growing without bound"
            )


class DynamicEmbedding(nn.Module):
    """An embedding table keyed by any int64 id, for hashed features; rows are created,
    admitted and evicted on the servers.

    Args:
        embedding_dim: the width of each row.
        mode: None for an ``nn.Embedding``-like lookup (one row per id, output shaped like the
            ids plus ``embedding_dim``); ``"sum"``, ``"mean"`` or ``"max"`` for an
            ``nn.EmbeddingBag``-like one (bags given by 2-D ids or by ``offsets``, with
            optional ``per_sample_weights``). Sum and mean bags can be pooled on the servers
            (``server_pooling``).
        min_count: admission. An id gets a row once it has been pulled for training in this
            many steps (calls), counting earlier steps and the current one; until then it reads
            as the default vector and only a counter is kept. Above 1 it needs ``ttl_steps``,
            so counters of ids never admitted expire.
        ttl_steps: expiry. A row (or counter) untouched for this many steps of the table's
            clock (the highest trainer step the server has seen) is evicted; None: never.
        capacity: rows per server. Above it the least recently used rows are evicted, down to
            95% of it, sparing the rows of the current step; None: no limit. A checkpoint
            restored onto servers whose capacity cannot hold its rows is refused.
        init_scale: a new row is drawn uniformly from ``[-init_scale, init_scale)`` by a rule
            of (table name, ``seed``, id), so a run is reproducible and an evicted id that
            returns starts from the same values.
        default_value: the value of every entry of the vector read for an id without a row.
        seed: the seed of that rule.

    A gradient reaches only the row it was computed from: one for an id that had no row when
    pulled, or whose row was evicted before the push, is dropped and counted (the summary's
    ``tables``). Evaluation reads create nothing. The module itself holds only the rows it was
    given (see the module docstring): it is a plain ``nn.Module`` outside a job.
    """

    def __init__(
        self,
        embedding_dim: int,
        *,
        mode: str | None = None,
        min_count: int = 1,
        ttl_steps: int | None = None,
        capacity: int | None = None,
        init_scale: float = 0.01,
        default_value: float = 0.0,
        seed: int = 0,
    ):
        super().__init__()
        if mode is not None and mode not in BAG_MODES:
            raise ValueError(f"mode must be None (an Embedding) or one of {BAG_MODES}")
        self.embedding_dim = embedding_dim
        self.mode = mode
        self.options = DynamicOptions(
            min_count=min_count,
            ttl_steps=ttl_steps,
            capacity=capacity,
            init_scale=init_scale,
            default_value=default_value,
            seed=seed,
        )
        self.register_buffer("ids", torch.empty(0, dtype=torch.int64))
        self.weight = nn.Parameter(torch.empty(0, embedding_dim))

    def extra_repr(self) -> str:
        return f"dim={self.embedding_dim}, mode={self.mode}, rows={self.ids.numel()}"

    def forward(
        self, input: Tensor, offsets: Tensor | None = None, per_sample_weights: Tensor | None = None
    ) -> Tensor:
        ids = input.to(torch.int64).contiguous()
        held = self.ids.numel()
        default = torch.full(
            (1, self.embedding_dim), self.options.default_value, dtype=self.weight.dtype
        )
        table = torch.cat([self.weight, default])
        if held:
            positions = torch.searchsorted(self.ids, ids).clamp_(max=held - 1)
            local = torch.where(self.ids[positions] == ids, positions, held)
        else:
            local = torch.full_like(ids, held)
        if self.mode is None:
            return F.embedding(local, table)
        return F.embedding_bag(
            local, table, offsets, mode=self.mode, per_sample_weights=per_sample_weights
        )

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        # Take the loaded row count, whatever this instance held before.
        ids, weight = state_dict.get(prefix + "ids"), state_dict.get(prefix + "weight")
        if isinstance(ids, Tensor) and isinstance(weight, Tensor):
            if (
                ids.dim() != 1
                or weight.shape[0] != ids.numel()
                or (ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()))
            ):
                raise ValueError(
                    f"{prefix}ids must be sorted, unique and one per row of {prefix}weight"
                )
            self.ids = torch.empty_like(ids)
            self.weight = nn.Parameter(torch.empty_like(weight))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
