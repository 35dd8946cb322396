"""``DynamicEmbedding``: an embedding table keyed by arbitrary int64 ids (hashed features).

Put it in a model where ``nn.Embedding`` (``mode=None``) or ``nn.EmbeddingBag`` (``mode="sum"``,
``"mean"`` or ``"max"``) would go when ids are 64-bit hashes rather than a fixed vocabulary.
Under paramserver it becomes a dynamic table sharded over the servers by hash bucket: a row is
created the first time an admitted id is trained on (initialized by a seeded rule, so a run is
reproducible), and rows can expire (``ttl_steps``) or be evicted least-recently-used above
``capacity`` rows per server. See :mod:`paramserver.server.tables` for the exact rules.

Outside paramserver (the trained ``result.model``, or a model loaded from its ``state_dict``),
the module holds the rows it was given: ``ids`` (sorted) and ``weight`` (one row per id). An id
it does not hold reads as the default vector; nothing is created. Its state_dict is plain
tensors (``ids``, ``weight``) and loads with any number of rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from paramserver.sharding import DynamicOptions

BAG_MODES = ("sum", "mean", "max")


class DynamicEmbedding(nn.Module):
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
