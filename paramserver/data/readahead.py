"""Reading ahead: an iterator run in a background thread, a bounded number of items ahead of
its consumer, so that reading and parsing input overlap with training.

:class:`ReadAhead` starts a daemon thread that iterates ``produce()`` and puts each item on a
queue of ``depth`` items; the consumer takes them in order. The thread blocks while the queue
is full, so at most ``depth`` items wait (plus the one being made). An exception raised by
the producer is raised again in the consumer, after the items made before it, with its own
traceback (the file and line a parse error names are in its message). The thread ends:

- when the producer is exhausted or fails (the consumer then gets StopIteration or the error);
- when the consumer calls :meth:`ReadAhead.close`, or drops its last reference to the
  iterator (a finalizer closes it): the producer is closed (``GeneratorExit`` at its
  ``yield``, so its ``with`` blocks close their files) and the thread joined. A consumer that
  stops early, a ``for`` loop left by ``break`` or an exception, leaves no thread behind once
  the iterator is gone.

Not thread-safe on the consumer side: one consumer per iterator.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class _End:
    """The last item a producer thread queues: why it stopped (None: exhausted)."""

    error: BaseException | None


class ReadAhead(Iterator[T], Generic[T]):
    """Iterates ``produce()`` in a thread named ``name``, up to ``depth`` items ahead."""

    def __init__(self, produce: Callable[[], Iterator[T]], depth: int, name: str):
        if depth < 1:
            raise ValueError(f"ReadAhead depth must be at least 1, got {depth}")
        items: queue.Queue[T | _End] = queue.Queue(maxsize=depth)
        stop = threading.Event()
        self._items = items
        self._thread = threading.Thread(
            target=_produce, args=(produce, items, stop), name=name, daemon=True
        )
        self._ended = False
        # Holds no reference to self: dropping the iterator stops the thread.
        self._finalizer = weakref.finalize(self, _stop, items, stop, self._thread)
        self._thread.start()

    def __next__(self) -> T:
        if self._ended:
            raise StopIteration
        item = self._items.get()
        if isinstance(item, _End):
            self.close()
            if item.error is not None:
                raise item.error
            raise StopIteration
        return item

    def close(self) -> None:
        """Stop the producer and wait for its thread to end; later calls of next() stop."""
        self._ended = True
        self._finalizer()

    @property
    def running(self) -> bool:
        """Whether the producer thread is still alive."""
        return self._thread.is_alive()


def _produce(produce: Callable[[], Iterator[T]], items: queue.Queue, stop: threading.Event) -> None:
    """The thread's body: every item, then the end, unless told to stop."""
    end = _End(None)
    try:
        source = produce()
        try:
            for item in source:
                if stop.is_set():
                    return
                items.put(item)
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()
    except BaseException as e:  # handed to the consumer, who raises it
        end = _End(e)
    if not stop.is_set():
        items.put(end)


def _stop(items: queue.Queue, stop: threading.Event, thread: threading.Thread) -> None:
    """Tell the producer to stop, unblock it (it may be waiting on a full queue) and join it."""
    stop.set()
    while thread.is_alive() and thread is not threading.current_thread():
        _drain(items)
        thread.join(timeout=0.01)
    _drain(items)


def _drain(items: queue.Queue) -> None:
    try:
        while True:
            items.get_nowait()
    except queue.Empty:
        pass
