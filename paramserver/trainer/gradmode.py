"""Grad mode turned off around a step's calls for one C call each: ``torch.no_grad()`` costs a
dozen Python calls each time it is entered (as a decorator it makes a new context manager per
call), and ``once_differentiable`` enters it again in every backward, which already runs with
grad off. A trainer's step enters several."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch
from torch.autograd.function import once_differentiable

P = ParamSpec("P")
R = TypeVar("R")


def without_grad(function: Callable[P, R]) -> Callable[P, R]:
    """``function`` run with grad mode off, as under ``@torch.no_grad()``."""

    @functools.wraps(function)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        if not torch.is_grad_enabled():
            return function(*args, **kwargs)
        torch._C._set_grad_enabled(False)  # what no_grad's __enter__ does, less its Python
        try:
            return function(*args, **kwargs)
        finally:
            torch._C._set_grad_enabled(True)

    return run


def differentiable_once(backward: Callable[..., Any]) -> Callable[..., Any]:
    """An autograd Function's ``backward`` as ``@once_differentiable`` makes it: run with grad
    off, and a second differentiation through it refused. A backward not asked for a graph
    (``create_graph`` false, every training step's) runs with grad off already and calls it
    directly; only one asked for a graph pays for ``once_differentiable``."""
    once = once_differentiable(backward)

    @functools.wraps(backward)
    def run(ctx: Any, *grads: Any) -> Any:
        if torch.is_grad_enabled():
            return once(ctx, *grads)
        return backward(ctx, *grads)

    return run
