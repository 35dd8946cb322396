"""A gate between a server's calls and the cuts of its change log, for a consistent cut.

An async call changes the store twice: its gradients are applied, then its answer is read
(rows admitted, touched, counted). A segment cut between the two would hold the one without
the other while its books count the call as taken, and a server recovered from it would
answer the trainer's resent call as a repeat, never making the read it missed. The gate lets
a cut in only between calls: it holds new calls back and waits for those in flight to pass.
The wait is the length of the calls in flight (they wait on nothing else) and the hold that
of the cut (a copy of the changed rows)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class CallGate:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._in_flight = 0
        self._cutting = False

    @contextmanager
    def call(self) -> Iterator[None]:
        """A call passes: from before it is admitted until its answer is read."""
        with self._changed:
            self._changed.wait_for(lambda: not self._cutting)
            self._in_flight += 1
        try:
            yield
        finally:
            with self._changed:
                self._in_flight -= 1
                if not self._in_flight:
                    self._changed.notify_all()

    @contextmanager
    def cut(self) -> Iterator[None]:
        """A cut, once no call is in flight; new calls wait until it is done."""
        with self._changed:
            self._changed.wait_for(lambda: not self._cutting)
            self._cutting = True
            self._changed.wait_for(lambda: not self._in_flight)
        try:
            yield
        finally:
            with self._changed:
                self._cutting = False
                self._changed.notify_all()
