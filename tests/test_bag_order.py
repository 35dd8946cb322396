"""The order a trainer's pooled lookups add a row's gradient terms in (paramserver/trainer/bags.py,
paramserver/_sort_order.cpp): the loops' sort order is torch.sort's on both sides of its two
thresholds (16 ids: std::sort's insertion sort; 32768: torch's stable radix sort), lookups of
that many ids (several of one table in one forward too) and of rows of any width are torch's
bitwise, forward and backward, and the check made at a process's first pooled lookup leaves
every lookup to torch, and says why once, where the loops' order or rounding is not torch's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from paramserver import native
from paramserver.trainer import bags
from tests.helpers import one_forward, remote_of, remotes_of

pytestmark = pytest.mark.skipif(native.loops is None, reason="the compiled loops are turned off")

ROWS, DIM = 40, 8
SIZES = [16, 17, 32_767, 32_768]
CASES = [("sum", False, None), ("mean", False, 6), ("sum", True, None), ("sum", True, 6)]


@pytest.fixture
def fresh_check() -> Iterator[None]:
    """The once-a-process check made again in the test, and again after it."""
    bags._agreement.cache_clear()
    yield
    bags._agreement.cache_clear()


@pytest.mark.parametrize("size", [1, 16, 17, 300, 32_767, 32_768, 40_000])
def test_sort_order_is_torchs(size: int) -> None:
    generator = torch.Generator().manual_seed(size)
    for distinct in (2, 1 + size // 10):
        ids = torch.randint(0, distinct, (size,), generator=generator)
        order = native.sort_order(ids.numpy())
        assert np.array_equal(np.sort(order), np.arange(size))  # a permutation
        assert np.array_equal(order, torch.sort(ids).indices.numpy())


def lookup(
    generator: torch.Generator, size: int, weighted: bool, padding: int | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``size`` ids of ``ROWS`` rows (hundreds of repeats at the larger sizes; every 7th the
    padding row where given) in bags of 0 to ~2 x 64 ids, and weights where asked."""
    ids = torch.randint(0, ROWS, (size,), generator=generator)
    if padding is not None:
        ids[::7] = padding
    lengths = torch.randint(0, 2 * 64, (size,), generator=generator)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    offsets = offsets[offsets < size]
    weights = torch.rand(size, generator=generator).requires_grad_(True) if weighted else None
    return ids, offsets, weights


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize(("mode", "weighted", "padding"), CASES)
@pytest.mark.parametrize("sparse", [False, True])
def test_lookups_around_the_sorts_thresholds_are_torchs(
    size: int, mode: str, weighted: bool, padding: int | None, sparse: bool
) -> None:
    """A layer with sparse=True sorts nothing: its gradient is torch's sparse one, made dense,
    at every size."""
    g = torch.Generator().manual_seed(size + 2 * weighted + (padding or 0))
    assert_lookup_is_torchs(g, size, DIM, mode, weighted, padding, sparse)


def assert_lookup_is_torchs(
    g: torch.Generator,
    size: int,
    dim: int,
    mode: str,
    weighted: bool,
    padding: int | None,
    sparse: bool = False,
) -> None:
    """A lookup of ``size`` ids (:func:`lookup`) of rows ``dim`` wide, by the loops, and its
    gradients (rows' and weights') are torch's bitwise (``sparse``: the layer's, made dense)."""
    layer = nn.EmbeddingBag(ROWS, dim, mode=mode, padding_idx=padding, sparse=sparse)
    ids, offsets, weights = lookup(g, size, weighted, padding)
    remote, rows = remote_of(layer, torch.unique(ids))
    got, want = remote(ids, offsets, weights), layer(ids, offsets, weights)
    assert got.grad_fn is not None and "_Lookup" in type(got.grad_fn).__name__
    assert torch.equal(got, want)
    grad = torch.randn(want.shape, generator=g)
    extra = [weights] if weights is not None else []
    got_grads = torch.autograd.grad(got, [rows, *extra], grad)
    want_grads = torch.autograd.grad(want, [layer.weight, *extra], grad)
    want_rows = want_grads[0].to_dense() if sparse else want_grads[0]
    assert torch.equal(got_grads[0], want_rows[torch.unique(ids)])
    if weights is not None:
        assert torch.equal(got_grads[1], want_grads[1])


@pytest.mark.parametrize(("mode", "weighted", "padding"), CASES)
def test_several_lookups_of_one_table_around_the_thresholds_are_torchs(
    mode: str, weighted: bool, padding: int | None
) -> None:
    """One forward's lookups of one table, one of each size: the rows' gradient sums each
    lookup's (added in its own sort's order) as autograd sums torch's."""
    g = torch.Generator().manual_seed(7 + 2 * weighted + (padding or 0))
    layer = nn.EmbeddingBag(ROWS, DIM, mode=mode, padding_idx=padding)
    lookups = [lookup(g, size, weighted, padding) for size in SIZES]
    pulled = torch.unique(torch.cat([ids for ids, _, _ in lookups]))
    remotes, rows_of, step = remotes_of({"t": layer}, {"t": pulled})
    remote, rows = remotes["t"], rows_of["t"]
    with one_forward(step):
        got = [remote(*each) for each in lookups]
    want = [layer(*each) for each in lookups]
    scales = [torch.randn(o.shape, generator=g) for o in want]

    def loss(outputs: list[Tensor]) -> Tensor:
        return sum(((o * s).sum() for o, s in zip(outputs, scales, strict=True)), torch.zeros(()))

    extra = [w for _, _, w in lookups if w is not None]
    got_grads = torch.autograd.grad(loss(got), [rows, *extra])
    want_grads = torch.autograd.grad(loss(want), [layer.weight, *extra])
    for got_out, want_out in zip(got, want, strict=True):
        assert torch.equal(got_out, want_out)
    assert torch.equal(got_grads[0], want_grads[0][pulled])
    for got_grad, want_grad in zip(got_grads[1:], want_grads[1:], strict=True):
        assert torch.equal(got_grad, want_grad)


def assert_left_to_torch(caplog: pytest.LogCaptureFixture, reason: str) -> None:
    """The check fails, saying ``reason`` once; lookups are torch's, and still right."""
    layer = nn.EmbeddingBag(ROWS, DIM, mode="sum")
    ids = torch.randint(0, ROWS, (100,), generator=torch.Generator().manual_seed(1))
    offsets = torch.arange(0, 100, 10)
    remote, _rows = remote_of(layer, torch.unique(ids))
    with caplog.at_level(logging.WARNING, logger=bags.__name__):
        for _ in range(3):
            got = remote(ids, offsets)
            assert got.grad_fn is not None and "EmbeddingBag" in type(got.grad_fn).__name__
            assert torch.equal(got, layer(ids, offsets))
    assert not bags.loops_agree_with_torch()
    warnings = [r.getMessage() for r in caplog.records if r.name == bags.__name__]
    assert len(warnings) == 1 and reason in warnings[0], warnings


def test_a_sort_order_not_torchs_leaves_lookups_to_torch(
    fresh_check: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As where torch's sort were stable (another build): a stable order is not torch's."""
    monkeypatch.setattr(native, "sort_order", lambda keys: np.argsort(keys, kind="stable"))
    assert_left_to_torch(caplog, "torch.sort orders 17 ids")


def test_a_rounding_not_torchs_leaves_lookups_to_torch(
    fresh_check: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As where the loops' float32 weighted bags rounded otherwise than torch's kernel."""
    pool_bags = native.pool_bags

    def rounded_otherwise(tables: list[Tensor], lookups: list[Any], dim: int) -> None:
        pool_bags(tables, lookups, dim)
        for lookup in lookups:
            out = lookup[7].view(-1)
            if lookup[3] is not None and out.dtype == torch.float32 and out.numel():
                out[0] = torch.nextafter(out[0], torch.tensor(torch.inf))

    monkeypatch.setattr(native, "pool_bags", rounded_otherwise)
    assert_left_to_torch(caplog, "a sum lookup of torch.float32 rows (weighted: True")


def test_the_check_passes_here_whatever_the_grad_mode(fresh_check: None) -> None:
    """This build's torch sorts and rounds as the loops do (else every lookup above would be
    torch's); a first lookup made without autograd (serving, evaluation) checks as well."""
    with torch.inference_mode():
        assert bags.loops_agree_with_torch()


@pytest.mark.parametrize("dim", [1, 15, 16, 17, 40])
@pytest.mark.parametrize(("mode", "weighted", "padding"), CASES)
def test_rows_of_any_width_are_torchs(
    dim: int, mode: str, weighted: bool, padding: int | None
) -> None:
    """The loops sum 16 columns at a time (a full block kept in registers, the rest column by
    column): rows narrower, as wide, and wider than a block or two pool and add back alike."""
    g = torch.Generator().manual_seed(dim + 2 * weighted + (padding or 0))
    assert_lookup_is_torchs(g, 300, dim, mode, weighted, padding)
