"""Stopping a job that reads a stream: the first SIGTERM or Ctrl-C asks every trainer to end its
input at its next step (:data:`paramserver.inputs.STOP`); the job then ends as a finite one
does: the trainers' last pushes, the final checkpoint (with each trainer's stream position),
the summary, status 0. A second signal stops at once, as a finite job's first does.

The launcher's process asks: the threads launcher sets ``STOP`` itself; the processes launcher
sends :data:`STOP_SIGNAL` to each trainer process, whose worker sets its own ``STOP``. Signal
handlers are installed from the main thread only (Python's rule); elsewhere the job stops as
a finite one does.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from paramserver.inputs import STOP

# The launcher's request to a trainer process: ignored by default, so a trainer still starting
# (its handler not installed yet) is not killed by it; the launcher asks again every second.
STOP_SIGNAL = signal.SIGWINCH
STOPPING = (
    "stopping: every trainer ends its input at its next step, then the final checkpoint is "
    "written (%s again stops at once)"
)

log = logging.getLogger(__name__)


@contextlib.contextmanager
def stops_gracefully(enabled: bool, request_stop: Callable[[], None]) -> Iterator[None]:
    """While the job runs (``enabled``: it reads a stream), the first SIGTERM or SIGINT calls
    ``request_stop`` and a second raises KeyboardInterrupt; the previous handlers come back
    after."""
    STOP.clear()  # a new job in this process (the threads launcher's) runs until asked
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    asked: list[int] = []

    def on_signal(signum: int, _: Any) -> None:
        if asked:
            raise KeyboardInterrupt
        asked.append(signum)
        log.warning(STOPPING, signal.Signals(signum).name)
        request_stop()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def stop_when_asked() -> None:
    """In a trainer process: :data:`STOP_SIGNAL` sets ``STOP``."""
    signal.signal(STOP_SIGNAL, lambda *_: STOP.set())
