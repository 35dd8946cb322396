"""A request past its checks: the one form the server works with once the wire is behind it.

A :class:`~paramserver.wire.messages.PushPullRequest` arrives as the wire has it: row ids packed,
gradients encoded, pooled gradients not yet turned into row gradients, any field possibly
malformed. The coordinator checks it whole and decodes it (server/requests.py), then hands on
a :class:`DecodedRequest`: ids as int64 tensors, gradients as float tensors, every part
validated. The coordinator's policies, the sync rounds and the shard see only this type, so
nothing after the checks asks which form it got.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from torch import Tensor

from paramserver.wire.compression import Encoded
from paramserver.wire.idcodec import PackedIds
from paramserver.wire.messages import BagBlock, PushPullRequest
from paramserver.wire.reports import TrainerReport


class RowGrads(NamedTuple):
    """One table's row gradients: ``ids`` sorted and unique, ``values`` ``[len(ids), dim]``."""

    ids: Tensor
    values: Tensor


@dataclass
class DecodedRequest:
    """What a validated request asks, decoded (see the module doc); fields as
    :class:`~paramserver.wire.messages.PushPullRequest` names them."""

    trainer: int
    call: int
    grads_call: int = -1
    grads_step: int = -1
    final: bool = False
    report: TrainerReport | None = None
    pull_dense: bool = True
    pull_dense_state: bool = False
    publish: bool = False
    dense_grads: dict[str, Tensor] = field(default_factory=dict)
    row_grads: dict[str, RowGrads] = field(default_factory=dict)
    pull_rows: dict[str, Tensor] = field(default_factory=dict)
    pull_versions: dict[str, Tensor] = field(default_factory=dict)
    pull_state: dict[str, Tensor] = field(default_factory=dict)
    pool_rows: dict[str, BagBlock] = field(default_factory=dict)
    # Tables whose row gradients came as the gradient of pooled sums: the call that pulled
    # the bags they were pooled from.
    pooled_from: dict[str, int] = field(default_factory=dict)
    buffers: dict[str, Tensor] = field(default_factory=dict)  # the chief's, to set

    @classmethod
    def of(cls, request: PushPullRequest) -> DecodedRequest:
        """``request`` once checked and decoded in place (its ids unpacked, its gradients
        decoded, its pooled gradients turned into row gradients): its one typed form, which
        shares the request's mappings of reads (nothing uses the request after this)."""
        rows = {n: RowGrads(_ids(b.ids), _values(b.values)) for n, b in request.row_grads.items()}
        return cls(
            request.trainer, request.call, request.grads_call, request.grads_step,
            request.final, request.report, request.pull_dense, request.pull_dense_state,
            request.publish, {name: _values(grad) for name, grad in request.dense_grads.items()},
            rows,
            {name: _ids(ids) for name, ids in request.pull_rows.items()},
            request.pull_versions, request.pull_state, request.pool_rows,
            {name: grad.pull_call for name, grad in request.pooled_grads.items()},
            request.buffers,
        )  # fmt: skip

    def drop_gradients(self) -> None:
        """Keep only the reads (a push too late for its round)."""
        self.buffers.clear()
        self.dense_grads.clear()
        self.row_grads.clear()

    @property
    def has_grads(self) -> bool:
        return bool(self.dense_grads) or bool(self.row_grads)


def _values(value: Tensor | Encoded) -> Tensor:
    if not isinstance(value, Tensor):  # decoding left one encoded: a bug, not a peer's error
        raise TypeError(f"an encoded gradient past decoding: {type(value).__name__}")
    return value


def _ids(ids: Tensor | PackedIds) -> Tensor:
    if not isinstance(ids, Tensor):
        raise TypeError(f"packed ids past decoding: {type(ids).__name__}")
    return ids
