"""Autograd's Python around a step's calls, for a C call or two each: grad mode turned off
(``torch.no_grad()`` costs a dozen Python calls each time it is entered, as a decorator making
a new context manager per call, and ``once_differentiable`` enters it again in every backward,
which already runs with grad off), and an autograd Function applied (``Function.apply``'s
preamble costs a call per argument, for functorch's wrappers). A trainer's step does each
several times."""

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


_APPLY = torch._C._FunctionBase.__dict__.get("apply")  # what Function.apply ends by calling


def applier(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``function.apply``, for arguments the trainer made itself (no functorch wrapper among
    them, which its preamble unwraps): the C call alone where no functorch transform is active
    (under one, ``function.apply`` says what it says: these Functions do not support them)."""
    if _APPLY is None:
        return function.apply
    bare = _APPLY.__get__(None, function)

    def apply(*args: Any) -> Any:
        if torch._C._are_functorch_transforms_active():
            return function.apply(*args)
        return bare(*args)

    return apply


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
