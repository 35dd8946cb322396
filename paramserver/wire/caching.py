"""The hot-row cache's policy on the wire: which rows a server sends a trainer that caches
them, and how the trainer reads off the answer which came (the cache itself:
``paramserver.trainer.cache``)."""

from __future__ import annotations

from torch import Tensor


def must_send(cached: Tensor, current: Tensor, bound: int) -> Tensor:
    """Which rows a server sends a trainer that caches: those it has not cached, those without
    a row (their default vector is not cached), and those more than ``bound`` (>= 0) updates
    behind. Decided by the server alone: the trainer reads it off the answer (:func:`rows_sent`)."""
    return (cached < 0) | (current < 0) | (current - cached > bound)


def rows_sent(cached: Tensor, held: Tensor) -> Tensor:
    """Which rows an answer carries, read off the versions it holds (``row_versions``): a row
    the trainer had not cached, or whose version changed. Those :func:`must_send` picks, without
    its bound: a cached row sent is missing (-1) or over ``bound >= 0`` updates newer, so its
    version differs from the cached one; a row not sent comes back with the cached version."""
    return (cached < 0) | (held != cached)
