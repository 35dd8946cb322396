"""A trainer's pooled lookups over its pulled rows (paramserver/trainer/bags.py): the compiled
loops and the fallback (torch's embedding_bag) against torch's embedding_bag on the whole table,
forward and backward, across modes, weights, padding, offsets, empty bags and types; and a
forward's bag lookups of several tables made in one node.

Pooled rows and gradients (rows' and weights') are torch's bitwise, several lookups of one
table included: the loops round a weight's product as torch's kernel for the case does, add a
row's terms in the order of torch's sort, by torch's multiply-adds (a layer with sparse=True:
in the ids' order, as torch's sparse gradient made dense), and sum the lookups' gradients in
autograd's order. The padding row is among the pulled rows wherever a lookup has
one (torch's full-table lookup takes another kernel than one without padding; a trainer that did
not pull its padding row looks up as one without, the loops and torch's fallback alike).
tests/test_bag_order.py tries lookups of more ids (around the sort's thresholds) and the check
that leaves lookups to torch where its sort or rounding differs from the loops'.
"""

from __future__ import annotations

import copy
import gc
import itertools
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from paramserver import native
from paramserver.trainer.bags import DenseGradient, _Step
from paramserver.trainer.replica import Call, Replica
from paramserver.wire.bundles import joined_already
from tests.helpers import one_forward, remote_of, remotes_of

ROWS, DIM = 40, 16
CASES = [
    (mode, weighted, padding, last, dtype)
    for mode, weighted, padding, last, dtype in itertools.product(
        ["sum", "mean"], [False, True], [None, 8], [False, True], [torch.float32, torch.float64]
    )
    if not (weighted and mode == "mean")
]


def batch(
    generator: torch.Generator, last: bool, padding: int | None = None
) -> tuple[Tensor, Tensor]:
    """300 ids of a few rows (many repeats; every 50th ``padding`` where given) in bags of 0 to
    100 ids, empty ones included."""
    ids = torch.randint(0, ROWS // 2, (300,), generator=generator) * 2  # every other row
    if padding is not None:
        ids[::50] = padding
    offsets = torch.tensor([0, 0, 5, 5, 17, 100, 299, 299])
    return ids, torch.cat([offsets, torch.tensor([300])]) if last else offsets


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize(("mode", "weighted", "padding", "last", "dtype"), CASES)
def test_pooled_lookups_and_gradients_are_torchs(
    loop_mode: str,
    mode: str,
    weighted: bool,
    padding: int | None,
    last: bool,
    dtype: torch.dtype,
    sparse: bool,
) -> None:
    """A layer with sparse=True: its gradient as torch's sparse one, made dense."""
    g = torch.Generator().manual_seed(len(mode) + 2 * weighted + 4 * last)
    layer = nn.EmbeddingBag(
        ROWS, DIM, mode=mode, padding_idx=padding, include_last_offset=last, dtype=dtype,
        sparse=sparse,
    )  # fmt: skip
    ids, offsets = batch(g, last, padding)
    weights = torch.rand(300, generator=g, dtype=dtype).requires_grad_(True) if weighted else None
    remote, rows = remote_of(layer, torch.unique(ids))
    got = remote(ids, offsets, weights)
    want = layer(ids, offsets, weights)
    assert torch.equal(got, want)
    grad = torch.randn(want.shape, generator=g, dtype=dtype)
    inputs = [rows] + ([weights] if weights is not None else [])
    got_grads = torch.autograd.grad(got, inputs, grad)
    want_grads = torch.autograd.grad(want, [layer.weight, *inputs[1:]], grad)
    assert torch.equal(got_grads[0], dense(want_grads[0])[torch.unique(ids)])
    if weighted:
        assert torch.equal(got_grads[1], want_grads[1])
    assert (got.grad_fn is not None) and (
        ("_Lookup" in type(got.grad_fn).__name__) == (loop_mode == "compiled")
    )


def test_two_d_bags_and_bags_torch_refuses(loop_mode: str) -> None:
    """Fixed-length bags (2-D ids, no offsets); bags not starting at 0 are torch's to refuse."""
    g = torch.Generator().manual_seed(3)
    layer = nn.EmbeddingBag(ROWS, DIM, mode="mean")
    ids = torch.randint(0, ROWS, (32, 5), generator=g)
    remote, _rows = remote_of(layer, torch.unique(ids))
    assert torch.equal(remote(ids), layer(ids))
    with pytest.raises(RuntimeError, match="offsets"):
        remote(ids.reshape(-1), torch.tensor([1, 4]))


def test_a_forwards_bag_lookups_of_several_tables_are_one_node(loop_mode: str) -> None:
    """Three tables (two float32 of one width, one float64), two lookups of one: in one
    forward, each (width, type) group's gradients come from one node, in one buffer."""
    g = torch.Generator().manual_seed(5)
    layers = {
        "a": nn.EmbeddingBag(ROWS, DIM, mode="sum"),
        "b": nn.EmbeddingBag(ROWS, DIM, mode="mean"),
        "c": nn.EmbeddingBag(ROWS, DIM, mode="sum", dtype=torch.float64),
    }
    ids = {t: torch.randint(0, ROWS, (64,), generator=g) for t in layers}
    offsets = torch.arange(0, 64, 4)
    remotes, rows, step = remotes_of(layers, {t: torch.unique(i) for t, i in ids.items()})
    with one_forward(step):
        got = [remotes[t](ids[t], offsets) for t in ("a", "b", "c", "a")]
    want = [layers[t](ids[t], offsets) for t in ("a", "b", "c", "a")]
    loss = sum((o.double() * (i + 1)).sum() for i, o in enumerate(got))
    grads = torch.autograd.grad(loss, [rows[t] for t in layers])
    expected_loss = sum((o.double() * (i + 1)).sum() for i, o in enumerate(want))
    expected = torch.autograd.grad(expected_loss, [layer.weight for layer in layers.values()])
    for got_out, want_out in zip(got, want, strict=True):
        assert torch.equal(got_out, want_out)
    for table, grad, full in zip(layers, grads, expected, strict=True):
        assert torch.equal(grad, full[torch.unique(ids[table])])
    if loop_mode == "compiled":
        steps = {id(_step_of(o)) for o in got[:2] + got[3:]}
        assert len(steps) == 1 and _step_of(got[2]) is not _step_of(got[0])
        assert grads[0].untyped_storage().data_ptr() == grads[1].untyped_storage().data_ptr()


@pytest.mark.skipif(native.loops is None, reason="the compiled loops are turned off")
def test_tables_gradients_fill_one_buffer_in_the_tables_order() -> None:
    """Whatever order autograd runs the lookups in, the tables' gradients lie end to end in
    their own order: a push sends that buffer as it is (not joined again)."""
    g = torch.Generator().manual_seed(6)
    layers = {t: nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True) for t in ("a", "b", "c")}
    ids = {t: torch.randint(0, ROWS, (64,), generator=g) for t in layers}
    remotes, rows, step = remotes_of(layers, {t: torch.unique(i) for t, i in ids.items()})
    with one_forward(step):
        got = [remotes[t](ids[t], torch.arange(0, 64, 4)) for t in ("c", "a", "b")]
    grads = torch.autograd.grad(
        sum(o.sum() * (i + 1) for i, o in enumerate(got)), list(rows.values())
    )
    assert joined_already(list(grads)) is not None


@pytest.mark.parametrize(("mode", "weighted", "padding", "last", "dtype"), CASES)
@pytest.mark.parametrize(("joined", "sparse"), [("summed", False), ("concatenated", False),
                                                ("summed", True)])  # fmt: skip
def test_several_lookups_of_one_table_give_torchs_gradients(
    loop_mode: str,
    mode: str,
    weighted: bool,
    padding: int | None,
    last: bool,
    dtype: torch.dtype,
    joined: str,
    sparse: bool,
) -> None:
    """Four lookups of one table in one forward: each lookup's gradient is torch's, and they
    are summed as autograd sums torch's (three or more: the grouping shows in the last bits),
    whether the outputs meet in a sum of losses or in one concatenation. With sparse=True,
    each lookup's sparse gradient made dense (:class:`DenseGradient`) before they are summed."""
    g = torch.Generator().manual_seed(11 + len(mode) + 2 * weighted + 4 * last)
    layer = nn.EmbeddingBag(
        ROWS, DIM, mode=mode, padding_idx=padding, include_last_offset=last, dtype=dtype,
        sparse=sparse,
    )  # fmt: skip
    batches = [batch(g, last, padding) for _ in range(4)]
    weights = [
        torch.rand(300, generator=g, dtype=dtype).requires_grad_(True) if weighted else None
        for _ in batches
    ]
    pulled = torch.unique(torch.cat([ids for ids, _ in batches]))
    remotes, rows_of, step = remotes_of({"t": layer}, {"t": pulled})
    remote, rows = remotes["t"], rows_of["t"]
    with one_forward(step):
        got = [remote(ids, offsets, w) for (ids, offsets), w in zip(batches, weights, strict=True)]
    want = [
        torchs(layer, ids, offsets, w) for (ids, offsets), w in zip(batches, weights, strict=True)
    ]
    scales = [torch.randn(o.shape, generator=g, dtype=dtype) for o in want]

    def loss(outputs: list[Tensor]) -> Tensor:
        if joined == "summed":
            return sum(((o * s).sum() for o, s in zip(outputs, scales, strict=True)),
                       torch.zeros((), dtype=dtype))  # fmt: skip
        return (torch.cat(outputs) * torch.cat(scales)).sum()

    for got_out, want_out in zip(got, want, strict=True):
        assert torch.equal(got_out, want_out)
    extra = [w for w in weights if w is not None]
    got_grads = torch.autograd.grad(loss(got), [rows, *extra])
    want_grads = torch.autograd.grad(loss(want), [layer.weight, *extra])
    assert torch.equal(got_grads[0], want_grads[0][pulled])
    for got_grad, want_grad in zip(got_grads[1:], want_grads[1:], strict=True):
        assert torch.equal(got_grad, want_grad)


def dense(grad: Tensor) -> Tensor:
    return grad.to_dense() if grad.is_sparse else grad


def torchs(
    layer: nn.EmbeddingBag, ids: Tensor, offsets: Tensor | None, weights: Tensor | None
) -> Tensor:
    """``layer``'s lookup; with sparse=True, its gradient made dense where it leaves the lookup
    (each lookup's from zero, then summed by autograd as dense ones are)."""
    if not layer.sparse:
        return layer(ids, offsets, weights)
    return F.embedding_bag(
        ids, DenseGradient.of(layer.weight), offsets, mode=layer.mode,
        per_sample_weights=weights, include_last_offset=layer.include_last_offset,
        padding_idx=layer.padding_idx, sparse=True,
    )  # fmt: skip


def _step_of(output: Tensor) -> object:
    """The node below a pooled lookup's own."""
    assert output.grad_fn is not None
    below = [f for f, _ in output.grad_fn.next_functions if f is not None]
    steps = [f for f in below if _Step.__name__ in type(f).__name__]
    assert len(steps) == 1
    return steps[0]


@pytest.mark.skipif(native.loops is None, reason="the compiled loops are turned off")
def test_bad_bags_are_refused_before_anything_is_written() -> None:
    loops = native.loops
    assert loops is not None
    table = np.ones((4, 2), dtype=np.float32)
    out, out3 = np.zeros((2, 2), dtype=np.float32), np.zeros((3, 2), dtype=np.float32)
    good = (0, np.array([0, 3]), np.array([0, 1, 2]), None, -1, False, False, out)
    bad = {
        "cover": (0, np.array([0, 3]), np.array([1, 1, 2]), None, -1, False, False, out),
        "end before": (0, np.array([0, 3]), np.array([0, 2, 1, 2]), None, -1, False, False, out3),
        "past its table": (0, np.array([0, 4]), np.array([0, 1, 2]), None, -1, False, False, out),
        "one weight per id": (0, np.array([0, 3]), np.array([0, 1, 2]),
                              np.ones(1, dtype=np.float32), -1, False, False, out),
        "one pooled row per bag": (0, np.array([0, 3]), np.array([0, 2]), None, -1, False,
                                   False, out),
        "of no table": (1, np.array([0, 3]), np.array([0, 1, 2]), None, -1, False, False, out),
    }  # fmt: skip
    for reason, lookup in bad.items():
        with pytest.raises(ValueError, match=reason):
            loops.pool_bags([table], [good, lookup], 2, False)
        grads = np.zeros((4, 2), dtype=np.float32)
        with pytest.raises(ValueError, match=reason):
            loops.scatter_bags([grads], [good, lookup], 2, False)
        assert not grads.any()
    assert not out.any() and not out3.any()
    with pytest.raises(ValueError, match="whole rows"):
        loops.pool_bags([np.ones(3, dtype=np.float32)], [], 2, False)
    with pytest.raises(ValueError, match="without an output"):
        loops.pool_bags([table], [(*good[:7], None)], 2, False)


def test_a_functional_lookup_with_sparse_true_takes_its_gradient_in_order(loop_mode: str) -> None:
    """``F.embedding_bag(..., sparse=True)`` on a table's weight: its gradient is torch's
    sparse one made dense, which the sorted order of a dense gradient is not (checked)."""
    g = torch.Generator().manual_seed(5)
    layer = nn.EmbeddingBag(ROWS, DIM, mode="sum")
    ids, offsets = batch(g, last=False)
    weights = torch.rand(300, generator=g) * 100
    grad = torch.randn(offsets.numel(), DIM, generator=g) * 1e3
    remote, rows = remote_of(layer, torch.unique(ids))
    found = {}
    for sparse in (False, True):
        leaf = layer.weight.detach().clone().requires_grad_(True)
        want = F.embedding_bag(
            ids, leaf, offsets, mode="sum", per_sample_weights=weights, sparse=sparse
        )
        (want_grad,) = torch.autograd.grad(want, [leaf], grad)
        got = F.embedding_bag(
            ids, remote.weight, offsets, mode="sum", per_sample_weights=weights, sparse=sparse
        )
        (found[sparse],) = torch.autograd.grad(got, [rows], grad)
        assert torch.equal(found[sparse], dense(want_grad)[torch.unique(ids)])
    assert not torch.equal(found[False], found[True])  # the orders differ in these bits


class ListBags(nn.Module):
    """Bags of four tables (two of another width), ids and offsets each an input of its
    own in lists, as facebookresearch's DLRM takes them."""

    def __init__(self) -> None:
        super().__init__()
        kinds = [(DIM, "sum", True), (DIM, "mean", False), (8, "sum", True), (8, "mean", True)]
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(ROWS, width, mode=mode, sparse=sparse) for width, mode, sparse in kinds
        )

    def forward(self, ids: list[Tensor], offsets: list[Tensor]) -> list[Tensor]:
        return [table(i, o) for table, i, o in zip(self.tables, ids, offsets, strict=True)]


def list_bags_call(seed: int, tables: int = 4) -> Call:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, ROWS, (90,), generator=g) for _ in range(tables)]
    offsets = [torch.tensor([0, 0, 7, 30, 31, 60]) for _ in range(tables)]
    return Call((ids, offsets))


def loaded(replica: Replica, model: nn.Module, call: Call) -> None:
    """Record ``call`` and load the rows it looks up from ``model``'s tables."""
    recorded = replica.record([call])
    weights = {f"tables.{t}.weight": layer.weight for t, layer in enumerate(model.tables)}
    rows = {t: (ids, weights[t].detach()[ids].clone()) for t, ids in recorded.ids.items()}
    replica.load({}, rows, lookups=recorded.lookups)


def test_a_forwards_bag_lookups_are_pooled_ahead_in_one_node(loop_mode: str) -> None:
    """Once a record pass has shown that each table's bags read its own inputs, a forward
    pools every table's bags at its first lookup, one node per width: outputs and gradients
    are torch's bitwise, and the step's nodes are freed as soon as it is done with."""
    model = ListBags()
    replica = Replica(copy.deepcopy(model))
    for seed in range(3):
        call = list_bags_call(seed)
        loaded(replica, model, call)
        got = replica.forward_fetching(call, fetch=_no_fetch)
        want = model(*call.args)
        for got_out, want_out in zip(got, want, strict=True):
            assert torch.equal(got_out, want_out)
        loss = sum((o * (i + 1)).sum() for i, o in enumerate(got))
        leaves = [replica.tables[f"tables.{t}.weight"].rows for t in range(4)]
        grads = torch.autograd.grad(loss, leaves)
        model.zero_grad()
        sum((o * (i + 1)).sum() for i, o in enumerate(want)).backward()
        for t, (grad, layer) in enumerate(zip(grads, model.tables, strict=True)):
            ids = replica.tables[f"tables.{t}.weight"].ids
            assert torch.equal(grad, dense(layer.weight.grad)[ids])
    if loop_mode != "compiled":
        return
    # All four tables pooled ahead: one node per width.
    assert {type(o.grad_fn).__name__ for o in got} == {"_LookupsBackward"}
    assert got[0].grad_fn is got[1].grad_fn and got[2].grad_fn is got[3].grad_fn
    assert got[0].grad_fn is not got[2].grad_fn
    node = weakref.ref(_step_of(got[0]))  # nothing holds a step's node but its graph
    gc.disable()
    try:
        del got, loss
        assert node() is None
    finally:
        gc.enable()


def test_bags_pooled_ahead_give_way_to_what_the_forward_looks_up(loop_mode: str) -> None:
    """A lookup whose bags are not those pooled ahead (its offsets changed in place after the
    forward's first lookup, or a copy) is made on its own, torch's bitwise, and its table's
    bags are no longer pooled ahead."""
    model = ListBags()
    replica = Replica(copy.deepcopy(model))
    tables = replica.model.tables

    def changing(ids: list[Tensor], offsets: list[Tensor]) -> list[Tensor]:
        first = tables[0](ids[0], offsets[0])  # every table's bags pooled ahead
        offsets[1][2] = 9
        offsets[3] = offsets[3].clone()
        return [first, *(tables[t](ids[t], offsets[t]) for t in (1, 2, 3))]

    call = list_bags_call(5)
    loaded(replica, model, call)
    replica._forward = changing
    got = replica.forward_fetching(call, fetch=_no_fetch)
    want = model(*call.args)  # of the offsets as changed
    for got_out, want_out in zip(got, want, strict=True):
        assert torch.equal(got_out, want_out)
    if loop_mode == "compiled":
        names = [type(o.grad_fn).__name__ for o in got]
        assert names == ["_LookupsBackward", "_LookupBackward"] * 2
        assert sorted(replica._step_lookups._bag_plans) == ["tables.0.weight", "tables.2.weight"]
        loaded(replica, model, list_bags_call(6))  # a record pass: it does not plan them again
        assert sorted(replica._step_lookups._bag_plans) == ["tables.0.weight", "tables.2.weight"]


def test_bags_pooled_ahead_and_not_looked_up_are_not_pooled_again(loop_mode: str) -> None:
    """A table whose bags a forward pooled ahead but never looked up (the record pass saw a
    lookup the forward does not make) is not pooled ahead at the next forward."""
    model = ListBags()
    replica = Replica(copy.deepcopy(model))
    tables = replica.model.tables
    call = list_bags_call(7)
    loaded(replica, model, call)
    replica._forward = lambda ids, offsets: [tables[t](ids[t], offsets[t]) for t in (0, 1, 2)]
    got = replica.forward_fetching(call, fetch=_no_fetch)
    for t, output in enumerate(got):
        assert torch.equal(output, model.tables[t](*(part[t] for part in call.args)))
    if loop_mode == "compiled":
        planned = sorted(replica._step_lookups._bag_plans)
        assert planned == [f"tables.{t}.weight" for t in (0, 1, 2)]


class ScaledBags(ListBags):
    """Two tables' bags read from the inputs, one scaling its gradient by frequency."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.tables = nn.ModuleList(
            [nn.EmbeddingBag(ROWS, DIM), nn.EmbeddingBag(ROWS, DIM, scale_grad_by_freq=True)]
        )


def test_bags_scaled_by_frequency_are_not_pooled_ahead(loop_mode: str) -> None:
    """A bag lookup whose gradient is scaled by its ids' frequency is torch's to make, its
    gradient torch's bitwise; the other table's bags are pooled ahead."""
    model = ScaledBags()
    replica = Replica(copy.deepcopy(model))
    call = list_bags_call(8, tables=2)
    loaded(replica, model, call)
    got = replica.forward_fetching(call, fetch=_no_fetch)
    want = model(*call.args)
    leaves = [replica.tables[f"tables.{t}.weight"].rows for t in range(2)]
    grads = torch.autograd.grad(sum(o.sum() for o in got), leaves)
    sum(o.sum() for o in want).backward()
    for t in range(2):
        ids = replica.tables[f"tables.{t}.weight"].ids
        assert torch.equal(got[t], want[t])
        assert torch.equal(grads[t], model.tables[t].weight.grad[ids])
    if loop_mode == "compiled":
        assert sorted(replica._step_lookups._bag_plans) == ["tables.0.weight"]


def _no_fetch(ids: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    raise AssertionError(f"rows of {sorted(ids)} were not pulled")
