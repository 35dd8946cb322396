"""Small helpers for :class:`torch.futures.Future`, the one way anything here waits.

A server never blocks a thread on another party: it answers with a Future completed later
(:func:`completed`, :func:`failed`, :func:`chain`). A trainer waits on its calls with
:func:`wait_all`, which also watches an alarm future (raised by its heartbeats when a server is
lost), so no wait outlives the job's first fatal error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch.futures import Future

ALARM_POLL_S = 0.05  # how often wait_all looks at its alarm

T = TypeVar("T")


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


def wait_all(futures: Sequence[Future], alarm: Future | None) -> list[object]:
    """The futures' values once all are done; raises the alarm's error if it goes off first.

    The alarm is polled (every ALARM_POLL_S) rather than given a callback: a callback per
    wait would pile up on the job-long alarm future."""
    if alarm is None or all(f.done() for f in futures):  # (prefetched answers often are)
        return [f.wait() for f in futures]
    done = threading.Event()
    torch.futures.collect_all(list(futures)).add_done_callback(lambda _: done.set())
    while not done.wait(ALARM_POLL_S):
        if alarm.done():
            alarm.wait()  # raises the alarm's error
    return [f.wait() for f in futures]


def in_order(items: Sequence[T], take: Callable[[T], Future]) -> Future:
    """``take`` each of ``items`` (at least one) once the one before it is answered; the last
    one's answer, or the first failure (the rest not taken)."""
    answered: Future = Future()
    last = len(items) - 1

    def take_from(at: int) -> None:  # the next once the last is answered (at once if it was)
        taken = take(items[at])
        taken.add_done_callback(lambda done: settle(done, at))

    def settle(done: Future, at: int) -> None:
        try:
            value = done.value()
        except Exception as error:
            answered.set_exception(error)
            return
        if at == last:
            answered.set_result(value)
        else:
            take_from(at + 1)

    take_from(0)
    return answered
