"""Grad mode turned off for one C call (paramserver/trainer/gradmode.py): the same as
``torch.no_grad()`` and ``once_differentiable`` where a step uses them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from paramserver.trainer.gradmode import applier, differentiable_once, without_grad


def test_without_grad_turns_grad_off_for_the_call_and_back_whatever_it_does() -> None:
    seen: list[bool] = []

    @without_grad
    def step(fail: bool) -> torch.Tensor:
        seen.append(torch.is_grad_enabled())
        if fail:
            raise ValueError("failed")
        return torch.ones(2, requires_grad=True) * 2

    assert step(False).grad_fn is None  # nothing recorded
    with pytest.raises(ValueError, match="failed"):
        step(True)
    assert torch.is_grad_enabled()
    with torch.no_grad():
        step(False)
        assert not torch.is_grad_enabled()  # left off where it was off
    assert seen == [False, False, False]


class _Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    @differentiable_once
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        assert not torch.is_grad_enabled()
        return grad * 3 * x**2


def test_differentiable_once_gives_the_gradient_and_refuses_a_second_differentiation() -> None:
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    _Cube.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.tensor([3.0, 12.0]))
    weights = torch.tensor([1.0, 1.0], requires_grad=True)  # the gradient in needs a graph
    (first,) = torch.autograd.grad((_Cube.apply(x) * weights).sum(), x, create_graph=True)
    assert torch.equal(first, torch.tensor([3.0, 12.0]))
    with pytest.raises(RuntimeError, match="once_differentiable"):
        first.sum().backward()


def test_applier_applies_the_function_as_apply_does() -> None:
    """The bare call gives what ``Function.apply`` gives, a graph included; under a functorch
    transform it is ``apply`` itself, which refuses these Functions (no setup_context)."""
    apply = applier(_Cube)
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    y = apply(x)
    assert torch.equal(y, _Cube.apply(x)) and type(y.grad_fn) is type(_Cube.apply(x).grad_fn)
    y.sum().backward()
    assert torch.equal(x.grad, torch.tensor([3.0, 12.0]))
    for function in (_Cube.apply, apply):
        with pytest.raises(RuntimeError, match="setup_context"):
            torch.func.grad(lambda t, f=function: f(t).sum())(torch.tensor([1.0]))
