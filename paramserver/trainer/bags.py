"""A trainer's pooled lookups (``EmbeddingBag``'s sum and mean, per-sample weights, a padding
row) over the rows pulled for a step, by the compiled loops (:func:`paramserver.native.pool_bags`)
instead of torch's generic ``embedding_bag``, whose dense backward sorts the ids and adds one
dispatched axpy per id, table by table (40% of a DLRM trainer's loop at batch 2048).

Forward sums each bag in its ids' order from zero, as torch's kernel does: the pooled rows are
torch's bitwise for sum and mean bags (a weight's product is fused into the sum, as fbgemm's
kernel does for float32). Backward adds each id's share of its bag's gradient (a multiply-add,
as torch's axpy) straight into its row's gradient, visiting the ids in the order torch's dense
backward does, that of ``torch.sort`` (unstable) of the lookup's ids, sorted in the forward;
several lookups of one table each add into a gradient of their own from zero, summed in the
order autograd adds torch's (the order their nodes ran in): a row's gradient, and a weight's
(torch's own kernel), are torch's bitwise, so a trainer's state does not depend on the loops.

The lookups of one forward join one node (:class:`BagNode`), as a step's plain lookups do
(:class:`~paramserver.trainer.lookups.StepLookups`): each lookup pools its bags in its own small
node, whose backward only hands its bags' gradients (and its weights') over; the step's node,
below every lookup's (they all read its one empty output, so autograd runs it after them),
adds them all into the rows' gradients in one call, each table's a view of one buffer. A lookup
the loops do not take (rows neither float32 nor float64, max bags, ``scale_grad_by_freq``, bags
not covering the ids in order) is torch's ``embedding_bag``, as is every lookup without them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from paramserver import native


@dataclass(frozen=True)
class Bags:
    """One pooled lookup in a table's pulled rows: each id's row (``positions``), where each
    bag starts (``starts``, with the end after the last bag), each id's weight (None: 1), the
    padding row's position (-1: none), whether bags are means, and the order backward visits
    the ids in (None: theirs; see the module docstring)."""

    positions: Tensor
    starts: Tensor
    weights: Tensor | None
    padding: int
    mean: bool
    order: Tensor | None = None

    @staticmethod
    def of(
        positions: Tensor,
        offsets: Tensor | None,
        weights: Tensor | None,
        mode: str,
        padding: int | None,
        include_last_offset: bool,
    ) -> Bags | None:
        """The bags of ``positions`` (the lookup's ids, found in the pulled rows, in
        ``EmbeddingBag``'s layout: 2-D, or 1-D with ``offsets``); None where the loops leave
        the lookup to torch (max bags, weights of mean bags, layouts torch itself refuses)."""
        if mode not in ("sum", "mean") or (weights is not None and mode != "sum"):
            return None
        if positions.dim() == 2 and offsets is None and not include_last_offset:
            count, length = positions.shape
            starts = torch.arange(0, count * length + 1, max(length, 1))
            if length == 0:
                starts = torch.zeros(count + 1, dtype=torch.int64)
        elif positions.dim() == 1 and offsets is not None and offsets.dim() == 1:
            starts = offsets.to(torch.int64)
            if not include_last_offset:
                starts = torch.cat([starts, torch.tensor([positions.numel()])])
            elif starts.numel() == 0:
                return None
        else:
            return None
        flat = None
        if weights is not None:
            if weights.shape != positions.shape:
                return None
            flat = weights.detach().reshape(-1).contiguous()
        return Bags(
            positions.reshape(-1).contiguous(),
            starts.contiguous(),
            flat,
            -1 if padding is None else padding,
            mode == "mean",
        )

    @property
    def num_bags(self) -> int:
        return self.starts.numel() - 1

    def sorted(self) -> Bags:
        """These bags, their backward to visit the ids in torch's order."""
        return replace(self, order=torch.sort(self.positions).indices)

    def arrays(self, table: int, pooled: Tensor | None) -> native.BagArrays:
        """This lookup as :func:`paramserver.native.pool_bags` takes it."""
        weights = None if self.weights is None else self.weights.numpy()
        out = None if pooled is None else pooled.numpy()
        order = None if self.order is None else self.order.numpy()
        return (table, self.positions.numpy(), self.starts.numpy(), weights, self.padding,
                self.mean, out, order)  # fmt: skip


def takes(rows: Tensor, weights: Tensor | None) -> bool:
    """Whether the loops pool bags of ``rows`` with ``weights`` (of the rows' type)."""
    return native.pools_rows(rows) and (weights is None or weights.dtype == rows.dtype)


class BagNode:
    """A forward's pooled lookups of several tables' rows (of one width and type), whose
    gradients one node adds into those rows' gradients (see the module docstring)."""

    def __init__(self, rows: list[Tensor]):
        self.rows = rows
        self.lookups: list[tuple[int, Bags]] = []
        self.grads: dict[int, Tensor] = {}  # each lookup's bag gradients, set by backward
        self.token = _Step.apply(self, *rows)

    def pool(self, table: int, bags: Bags, weights: Tensor | None) -> Tensor | None:
        """``bags`` of ``self.rows[table]`` pooled (None: the bags are not sound, torch is to
        say why); ``weights``: the lookup's per-sample weights, as given."""
        if torch.is_grad_enabled() and self.rows[table].requires_grad:
            bags = bags.sorted()
        try:
            pooled = _Lookup.apply(self, table, bags, self.token, weights)
        except ValueError:
            return None
        self.lookups.append((table, bags))
        return pooled


def pooled_lookup(
    rows: Tensor, bags: Bags, weights: Tensor | None, node: BagNode | None = None
) -> Tensor | None:
    """``bags`` of ``rows`` pooled, joining ``node`` (a step's node holding ``rows``) where
    given, else in a node of their own; None where torch is to pool them."""
    if node is None:
        node = BagNode([rows])
    return node.pool(next(i for i, r in enumerate(node.rows) if r is rows), bags, weights)


class _Step(torch.autograd.Function):
    """The node below a forward's pooled lookups: its output, an empty tensor, is read by each
    lookup's node; its backward adds every lookup's bag gradients into the rows' gradients."""

    @staticmethod
    def forward(ctx: Any, node: BagNode, *rows: Tensor) -> Tensor:
        ctx.node = node
        ctx.set_materialize_grads(False)
        return torch.empty(0, dtype=rows[0].dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, _: Tensor | None) -> tuple[Tensor | None, ...]:
        node: BagNode = ctx.node
        grads, node.grads = node.grads, {}
        # In the order autograd ran the lookups' nodes: the order it would add torch's.
        numbers = list(grads)
        if not numbers:
            return (None,) * (len(node.rows) + 1)
        tables = [node.lookups[number][0] for number in numbers]
        firsts: dict[int, int] = {}  # each table's first lookup: the others add into its own
        for number, table in zip(numbers, tables, strict=True):
            firsts.setdefault(table, number)
        sizes = [node.rows[t].shape[0] for t in tables]
        dim, dtype = node.rows[0].shape[1], node.rows[0].dtype
        buffer = torch.zeros(sum(sizes), dim, dtype=dtype).split(sizes)
        parts = dict(zip(numbers, buffer, strict=True))  # each lookup's gradient, from zero
        native.scatter_bags(
            [part.numpy() for part in buffer],
            [node.lookups[number][1].arrays(i, grads[number]) for i, number in enumerate(numbers)],
            dim,
        )
        for number, table in zip(numbers, tables, strict=True):
            if firsts[table] != number:
                parts[firsts[table]].add_(parts[number])
        by_table = {table: parts[number] for table, number in firsts.items()}
        return (None, *(by_table.get(t) for t in range(len(node.rows))))


class _Lookup(torch.autograd.Function):
    """One pooled lookup's node: it hands its bags' gradients to its :class:`BagNode`, and
    gives its weights' gradients (each id's row dotted with its bag's gradient)."""

    @staticmethod
    def forward(
        ctx: Any, node: BagNode, table: int, bags: Bags, token: Tensor, weights: Tensor | None
    ) -> Tensor:
        rows = node.rows[table].detach()
        pooled = torch.empty(bags.num_bags, rows.shape[1], dtype=rows.dtype)
        native.pool_bags([rows.numpy()], [bags.arrays(0, pooled)], rows.shape[1])
        ctx.node, ctx.number = node, len(node.lookups)
        ctx.weights_shape = None if weights is None else weights.shape
        ctx.set_materialize_grads(False)
        return pooled

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor | None) -> tuple[Tensor | None, ...]:
        node: BagNode = ctx.node
        table, bags = node.lookups[ctx.number]
        if grad is None:
            return None, None, None, None, None
        grad = grad.contiguous()
        node.grads[ctx.number] = grad
        token = torch.empty(0, dtype=grad.dtype)
        weights_grad = None
        if bags.weights is not None and ctx.needs_input_grad[4]:
            weights_grad = _weights_grad(node.rows[table].detach(), bags, grad)
            weights_grad = weights_grad.view(ctx.weights_shape)
        return None, None, None, token, weights_grad


def _weights_grad(rows: Tensor, bags: Bags, grad: Tensor) -> Tensor:
    """Each id's weight's gradient: its row dotted with its bag's gradient (0 for padding), by
    torch's own kernel (its dot's order is its BLAS's)."""
    sizes = bags.starts.diff()
    bag_of = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
    return torch.ops.aten._embedding_bag_per_sample_weights_backward(
        grad, rows, bags.positions, bags.starts[:-1], bag_of, 0, bags.padding
    )
