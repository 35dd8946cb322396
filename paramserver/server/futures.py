"""Small helpers for :class:`torch.futures.Future`, the only way a server waits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.futures import Future


def completed(value: object) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def failed(error: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future


def chain(source: Future, transform: Callable[[Any], Any]) -> Future:
    """A future of ``transform(source's value)``; an error passes through with its type kept
    (``Future.then`` would wrap it in a RuntimeError)."""
    result: Future = Future()

    def forward(done: Future) -> None:
        try:
            value = transform(done.value())
        except BaseException as error:
            result.set_exception(error)
        else:
            result.set_result(value)

    source.add_done_callback(forward)
    return result
