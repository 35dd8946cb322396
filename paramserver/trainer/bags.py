"""A trainer's pooled lookups (``EmbeddingBag``'s sum and mean, per-sample weights, a padding
row) over the rows pulled for a step, by the compiled loops (:func:`paramserver.native.pool_bags`)
instead of torch's generic ``embedding_bag``, whose dense backward sorts the ids and adds one
dispatched axpy per id, table by table (40% of a DLRM trainer's loop at batch 2048).

Forward sums each bag in its ids' order from zero, as torch's kernel does, a weight's product
rounded as torch's kernel for the case rounds it (fused into the sum by fbgemm's for float32
without padding, rounded first by torch's own loop else): pooled rows are torch's bitwise.
Backward adds each id's share of its bag's gradient straight into its row's gradient, as torch
makes the gradient of the layer's ``sparse`` setting:

- ``sparse=True`` (as DLRMs are written): id by id in the lookup's order, each share's product
  rounded, then added: torch's sparse gradient made dense (:class:`DenseGradient`). Nothing is
  sorted, as one process with sparse gradients sorts nothing;
- ``sparse=False``: a multiply-add per id, as torch's axpy, visiting the ids in the order
  torch's dense backward does, that of ``torch.sort`` of the lookup's ids: the loop computes it
  (:func:`paramserver.native.sort_order`: C++'s ``std::sort``, as torch's sort below 32768 ids;
  no sort from there, where torch's radix sort is stable). That sort is most of the backward's
  cost at large batches (``benchmarks/bench_field.py``).

Several lookups of one table each add into a gradient of their own from zero, summed in the
order autograd adds torch's (the order their nodes ran in): a row's gradient, and a weight's
(torch's own kernel), are torch's bitwise, so a trainer's state does not depend on the loops.

Those orders and roundings are torch's as built (this torch, its C++ library, this machine's
CPU). At its first pooled lookup a process checks them once (:func:`loops_agree_with_torch`):
the loops' sort order against ``torch.sort`` on ids with many repeats at sizes around both
thresholds, and a few small lookups, forward and backward, against ``embedding_bag``. Where
anything differs, every pooled lookup is torch's, and the log says why, once.

The lookups of one forward join one node (:class:`BagNode`), as a step's plain lookups do
(:class:`~paramserver.trainer.lookups.StepLookups`): each lookup pools its bags in its own small
node, or several unweighted lookups pooled ahead share one (:meth:`BagNode.pool_all`), whose
backward only hands their bags' gradients (and weights') over; the step's node,
below every lookup's (they all read its one empty output, so autograd runs it after them),
adds them all into the rows' gradients in one call, each table's a view of one buffer. A lookup
the loops do not take (rows neither float32 nor float64, max bags, ``scale_grad_by_freq``, bags
not covering the ids in order) is torch's ``embedding_bag``, as is every lookup without them.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, NamedTuple, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from paramserver import native
from paramserver.trainer.gradmode import applier, differentiable_once

log = logging.getLogger(__name__)


class Bags(NamedTuple):
    """One pooled lookup in a table's pulled rows: each id's row (``positions``), where each
    bag starts (``starts``, with the end after the last bag), each id's weight (None: 1), the
    padding row's position (-1: none), and whether bags are means: contiguous, int64 (and
    the rows' type for weights), as the loops take them, in a tuple: a lookup's Python costs
    about what torch's whole ``embedding_bag`` does at batch 128, so it makes no tensor and
    no object it need not (the starts, a numpy array, are made without one)."""

    positions: Tensor
    starts: np.ndarray
    weights: Tensor | None
    padding: int
    mean: bool
    in_order: bool  # backward in the ids' order, as a sparse gradient (see the module docstring)

    @staticmethod
    def of(
        positions: Tensor,
        offsets: Tensor | None,
        weights: Tensor | None,
        mode: str,
        padding: int | None,
        include_last_offset: bool,
        in_order: bool = False,
    ) -> Bags | None:
        """The bags of ``positions`` (the lookup's ids, found in the pulled rows, in
        ``EmbeddingBag``'s layout: 2-D, or 1-D with ``offsets``); None where the loops leave
        the lookup to torch (max bags, weights of mean bags, layouts torch itself refuses)."""
        if mode not in ("sum", "mean") or (weights is not None and mode != "sum"):
            return None
        if positions.dtype != torch.int64:
            return None
        starts = _starts(positions, offsets, include_last_offset)
        if starts is None:
            return None
        flat_weights = None
        if weights is not None:
            if weights.shape != positions.shape:
                return None
            flat_weights = weights.detach().reshape(-1).contiguous()
        flat = positions if positions.dim() == 1 else positions.reshape(-1)
        return Bags(
            flat if flat.is_contiguous() else flat.contiguous(),
            starts,
            flat_weights,
            -1 if padding is None else padding,
            mode == "mean",
            in_order,
        )

    @property
    def num_bags(self) -> int:
        return self.starts.size - 1

    def arrays(self, table: int, pooled: Tensor | None) -> native.BagArrays:
        """This lookup as :func:`paramserver.native.pool_bags` takes it."""
        return (
            table, self.positions, self.starts, self.weights, self.padding, self.mean,
            self.in_order, pooled,
        )  # fmt: skip


def _starts(
    positions: Tensor, offsets: Tensor | None, include_last_offset: bool
) -> np.ndarray | None:
    """Where each bag of ``positions`` starts, and the end after the last (int64); None for a
    layout the loops leave to torch (to refuse, where it is unsound)."""
    if positions.dim() == 2 and offsets is None and not include_last_offset:
        count, length = positions.shape
        if length == 0:
            return np.zeros(count + 1, dtype=np.int64)
        return np.arange(0, count * length + 1, length, dtype=np.int64)
    if (
        positions.dim() != 1
        or offsets is None
        or offsets.dim() != 1
        or offsets.dtype not in (torch.int32, torch.int64)
    ):
        return None
    given = offsets.numpy()
    if include_last_offset:
        return np.ascontiguousarray(given, dtype=np.int64) if given.size else None
    starts = np.empty(given.size + 1, dtype=np.int64)
    starts[:-1] = given
    starts[-1] = positions.numel()
    return starts


def takes(rows: Tensor, weights: Tensor | None) -> bool:
    """Whether the loops pool bags of ``rows`` with ``weights`` (of the rows' type), giving
    torch's results in this process (:func:`loops_agree_with_torch`)."""
    return (
        native.pools_rows(rows)
        and (weights is None or weights.dtype == rows.dtype)
        and loops_agree_with_torch()
    )


ORDER_CHECKS = (
    (2, 2), (16, 3), (16, 8), (17, 3), (17, 8), (100, 3), (100, 30), (5_000, 3), (5_000, 600),
    (32_767, 3), (32_767, 4_000), (32_768, 3),
)  # fmt: skip
"""The arrays of ids (their number, drawn from how many values) that
:func:`loops_agree_with_torch` sorts both ways: around 16 ids (where std::sort sorts by
insertion), some between, and around 32768 (where torch's sort turns radix: one array there, as
a radix sort in torch's thread pool can cost a loaded machine 0.1 s)."""


def loops_agree_with_torch() -> bool:
    """Whether the loops' pooled lookups are torch's bitwise in this process (module
    docstring); checked once, at the first call, by sorts and lookups on a generator of its
    own (the global random state is untouched), whatever the grad mode: ~20 ms with one torch
    thread, more with several on a busy machine (torch's radix sort spins up its pool).
    Where they are not, logs why (a warning, once) and returns False: every pooled lookup is
    then torch's. Thread-safe: trainers that are threads of one process check once."""
    with _checking:
        return _agreement()


_checking = threading.Lock()


@functools.cache
def _agreement() -> bool:
    with torch.inference_mode(False), torch.enable_grad():
        reason = _disagreement()
    if reason is not None:
        log.warning("pooled lookups are left to torch's embedding_bag: %s", reason)
    return reason is None


def _disagreement() -> str | None:
    """How the loops differ from torch here (None: they agree wherever checked)."""
    generator = torch.Generator().manual_seed(0)
    for size, distinct in ORDER_CHECKS:  # many repeats: an unstable sort's order shows
        ids = torch.randint(0, distinct, (size,), generator=generator)
        if not np.array_equal(native.sort_order(ids.numpy()), torch.sort(ids).indices):
            return (
                f"torch.sort orders {size} ids of {distinct} values otherwise than the loops' "
                "backward would (another torch build or C++ library)"
            )
    for dtype in (torch.float32, torch.float64):
        for mode, weighted, padding in (
            ("sum", False, None), ("mean", False, 3), ("sum", True, None), ("sum", True, 3)
        ):  # fmt: skip
            for sparse in (False, True):
                if not _lookup_agrees(generator, dtype, mode, weighted, padding, sparse):
                    return (
                        f"a {mode} lookup of {dtype} rows (weighted: {weighted}, padding: "
                        f"{padding}, sparse: {sparse}) rounds otherwise than torch's "
                        "embedding_bag on this machine"
                    )
    return None


def _lookup_agrees(
    generator: torch.Generator,
    dtype: torch.dtype,
    mode: str,
    weighted: bool,
    padding: int | None,
    sparse: bool,
) -> bool:
    """Whether a small pooled lookup by the loops, and its gradients, are torch's bitwise
    (rows 20 wide: a block of 16 columns and the rest, the loops' two ways to sum them;
    ``sparse``: the gradient of a layer with sparse=True, made dense)."""
    rows = torch.randn(20, 20, generator=generator, dtype=dtype)
    ids = torch.randint(0, 20, (200,), generator=generator)
    offsets = torch.tensor([0, 0, 3, 50, 50, 120])
    weights = torch.rand(200, generator=generator, dtype=dtype) if weighted else None
    grad = torch.randn(offsets.numel(), 20, generator=generator, dtype=dtype)
    bags = Bags.of(ids, offsets, weights, mode, padding, include_last_offset=False, in_order=sparse)
    assert bags is not None
    results = []
    for looped in (True, False):
        leaf = rows.clone().requires_grad_(True)
        weights_leaf = None if weights is None else weights.clone().requires_grad_(True)
        if looped:
            pooled = pooled_lookup(leaf, bags, weights_leaf)
        else:
            pooled = F.embedding_bag(
                ids, DenseGradient.of(leaf) if sparse else leaf, offsets, mode=mode,
                padding_idx=padding, per_sample_weights=weights_leaf, sparse=sparse,
            )  # fmt: skip
        if pooled is None:
            return False
        inputs = [leaf] + ([weights_leaf] if weights_leaf is not None else [])
        # A scalar's backward (pooled's gradient is `grad`, exactly): autograd.grad given
        # grad_outputs imports sympy, half a second a process that training never spends.
        loss = (pooled * grad).sum()
        results.append([pooled.detach(), *torch.autograd.grad(loss, inputs)])
    return all(torch.equal(a, b) for a, b in zip(*results, strict=True))


class DenseGradient(torch.autograd.Function):
    """Rows as they are, whose gradient reaches them dense: where a lookup with
    ``sparse=True`` makes it sparse, its terms are added id by id in their order
    (``to_dense``), each lookup's from zero, as the loops add them in order."""

    @staticmethod
    def of(rows: Tensor) -> Tensor:
        return cast(Tensor, DenseGradient.apply(rows))

    @staticmethod
    def forward(ctx: Any, rows: Tensor) -> Tensor:
        return rows.view_as(rows)

    @staticmethod
    @differentiable_once
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.to_dense() if grad.is_sparse else grad


class BagNode:
    """A forward's pooled lookups of several tables' rows (of one width and type), whose
    gradients one node adds into those rows' gradients (see the module docstring)."""

    def __init__(self, rows: list[Tensor]):
        self.rows = rows
        self.tables = {id(r): t for t, r in enumerate(rows)}  # each rows' number, by identity
        self.lookups: list[tuple[int, Bags]] = []
        self.grads: dict[int, Tensor] = {}  # each lookup's bag gradients, set by backward
        self.token: Tensor | None = _apply_step(self, *rows)

    def close(self) -> None:
        """No more lookups join: the node lets go of its token, whose node holds it (a cycle
        that would leave the step's arrays to Python's cycle collector, and its time)."""
        self.token = None

    def pool(self, table: int, bags: Bags, weights: Tensor | None) -> Tensor | None:
        """``bags`` of ``self.rows[table]`` pooled (None: the bags are not sound, torch is to
        say why); ``weights``: the lookup's per-sample weights, as given."""
        try:
            pooled = _apply_lookup(self, table, bags, self.token, weights)
        except ValueError:
            return None
        self.lookups.append((table, bags))
        return pooled

    def pool_all(self, lookups: list[tuple[int, Bags]]) -> tuple[Tensor, ...] | None:
        """Several unweighted lookups (``(table, bags)``) pooled in one node and one call of
        the loops, each its own output; None where some bags are not sound (nothing pooled)."""
        try:
            return cast(tuple[Tensor, ...], _apply_lookups(self, lookups, self.token))
        except ValueError:
            return None


def pooled_lookup(
    rows: Tensor, bags: Bags, weights: Tensor | None, node: BagNode | None = None
) -> Tensor | None:
    """``bags`` of ``rows`` pooled, joining ``node`` (a step's node holding ``rows``) where
    given, else in a node of their own; None where torch is to pool them."""
    if node is not None:
        return node.pool(node.tables[id(rows)], bags, weights)
    node = BagNode([rows])
    pooled = node.pool(0, bags, weights)
    node.close()
    return pooled


class _Step(torch.autograd.Function):
    """The node below a forward's pooled lookups: its output, an empty tensor, is read by each
    lookup's node; its backward adds every lookup's bag gradients into the rows' gradients."""

    @staticmethod
    def forward(ctx: Any, node: BagNode, *rows: Tensor) -> Tensor:
        ctx.node = node
        ctx.set_materialize_grads(False)
        return torch.empty(0, dtype=rows[0].dtype)

    @staticmethod
    @differentiable_once
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
        # Each lookup's gradient from zero, in one buffer: the tables' (their first lookups')
        # in the tables' order, so that a push sends them as the one buffer they fill
        # (bundles.joined_already), not joined again; any other lookup's after them.
        laid_out = [firsts[t] for t in sorted(firsts)]
        laid_out += [n for n in numbers if firsts[node.lookups[n][0]] != n]
        sizes = [node.rows[node.lookups[number][0]].shape[0] for number in laid_out]
        dim, dtype = node.rows[0].shape[1], node.rows[0].dtype
        parts = dict(zip(laid_out, native.zeroed_parts(sizes, dim, dtype), strict=True))
        native.scatter_bags(
            [parts[number] for number in numbers],
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
        rows = node.rows[table]
        pooled = torch.empty(bags.num_bags, rows.shape[1], dtype=rows.dtype)
        native.pool_bags([rows], [bags.arrays(0, pooled)], rows.shape[1])
        ctx.node, ctx.number = node, len(node.lookups)
        ctx.weights_shape = None if weights is None else weights.shape
        ctx.set_materialize_grads(False)
        return pooled

    @staticmethod
    @differentiable_once
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


class _Lookups(torch.autograd.Function):
    """Several unweighted pooled lookups' node (:meth:`BagNode.pool_all`): one call of the
    loops forward; backward hands each lookup's bag gradients to the :class:`BagNode`, as
    :class:`_Lookup` does for one."""

    @staticmethod
    def forward(
        ctx: Any, node: BagNode, lookups: list[tuple[int, Bags]], token: Tensor
    ) -> tuple[Tensor, ...]:
        rows = node.rows
        dim = rows[0].shape[1]
        outputs = tuple(torch.empty(b.num_bags, dim, dtype=rows[t].dtype) for t, b in lookups)
        native.pool_bags(
            rows, [b.arrays(t, o) for (t, b), o in zip(lookups, outputs, strict=True)], dim
        )
        ctx.node, ctx.first = node, len(node.lookups)
        node.lookups.extend(lookups)
        ctx.set_materialize_grads(False)
        return outputs

    @staticmethod
    @differentiable_once
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        node: BagNode = ctx.node
        dtype = None  # of the gradients handed over: the token's (none: no token)
        for number, grad in enumerate(grads, ctx.first):
            if grad is not None:
                node.grads[number], dtype = grad.contiguous(), grad.dtype
        return None, None, None if dtype is None else torch.empty(0, dtype=dtype)


def _weights_grad(rows: Tensor, bags: Bags, grad: Tensor) -> Tensor:
    """Each id's weight's gradient: its row dotted with its bag's gradient (0 for padding), by
    torch's own kernel (its dot's order is its BLAS's)."""
    positions, starts = bags.positions, torch.from_numpy(bags.starts)
    sizes = starts.diff()
    bag_of = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
    return torch.ops.aten._embedding_bag_per_sample_weights_backward(
        grad, rows, positions, starts[:-1], bag_of, 0, bags.padding
    )


_apply_step, _apply_lookup, _apply_lookups = (applier(f) for f in (_Step, _Lookup, _Lookups))
