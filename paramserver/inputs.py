"""Inputs that do not end: what a trainer needs of a stream, and how a job is asked to stop.

A file is read again from its start and a resume skips the batches trained before the
checkpoint. A stream cannot be skipped through: it is read once, by a consumer that knows where
it is. :class:`PositionedInput` is what the trainer asks of such an input (the stream sources
of :mod:`paramserver.streams` are ones):

- ``position()``: where the batches handed out so far end, as JSON (a stream entry's id, a file
  and a line, ...). A checkpoint saves it, atomically with the model state it covers: the
  position after the last step the checkpoint's model holds.
- ``seek(position)``: before the first batch, continue right after ``position`` (a resume).
- ``acknowledge(position)``: a committed checkpoint covers the input up to ``position``; a
  source whose broker redelivers what is not acknowledged (a Redis consumer group) tells it
  now, never earlier.

A record then affects the model exactly once across failures: the broker delivers at least
once, a resume reads again exactly what came after the saved position, and the servers take
each call once (see README, "Online training").

:data:`STOP` is this process's request to end a job that has no end of its own: set by
SIGTERM or Ctrl-C (see :func:`paramserver.launch.stopping`), it ends every trainer's input at the
next step, after which the job ends as a finite one does (its final push, its final
checkpoint, status 0).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

STOP = threading.Event()
"""Set once this process is asked to stop training (its trainers end their input)."""


def reads_a_stream(data_fn: object) -> bool:
    """Whether a job's ``data_fn`` gives its trainers stream readers: it says so with a
    ``positioned = True`` attribute (:class:`paramserver.streams.RedisStream` does)."""
    return getattr(data_fn, "positioned", False) is True


@runtime_checkable
class PositionedInput(Protocol):
    """An iterable of batches over an input that does not restart (see the module doc)."""

    def __iter__(self) -> Iterator[Any]: ...

    def position(self) -> Any:
        """Where the batches handed out so far end (JSON; None before the first)."""

    def seek(self, position: Any) -> None:
        """Before iterating: continue right after ``position``."""

    def acknowledge(self, position: Any) -> None:
        """A committed checkpoint covers the input up to ``position``."""
