"""A training server's publisher: it cuts its store's changes into segments and appends them
to its chain, every ``every_s`` seconds or when told.

Cutting (:func:`~paramserver.changelog.collect.cut`) copies the changed rows under the
store's locks in the caller's thread: quick, and in a sync job the round's own thread, so a
segment ends exactly at a round. Writing (encode, fsync, rename, manifest) happens in the
publisher's thread, in order. A timed cut with nothing changed since the last is skipped.

A segment that cannot be written (a full disk) stays first in line and is tried again each
period, so the chain never skips one; each failure is logged and counted. Meanwhile no further
segment is cut (the store's changes keep gathering, and the first cut after the write
succeeds covers all of them), so a long outage costs no more memory than the changes
themselves; the closing cut always goes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from paramserver.changelog.collect import attach_collector, cut, full_cut
from paramserver.changelog.log import DEFAULT_KEEP, LogWriter
from paramserver.changelog.segment import Segment
from paramserver.store.store import Store

logger = logging.getLogger(__name__)


@dataclass
class PublishStats:
    segments: int = 0
    rows: int = 0
    removed: int = 0
    bytes: int = 0
    write_seconds: float = 0.0
    failures: int = 0


class Publisher:
    """Server ``server``'s publisher (see the module doc) for ``store``, into ``root``."""

    def __init__(
        self,
        store: Store,
        root: str | os.PathLike[str],
        writer: str,
        *,
        every_s: float,
        codec: str = "none",
        keep: int = DEFAULT_KEEP,
        timed: bool = True,
        recovers: bool = False,
        books: Callable[[], dict[str, Any]] | None = None,
        between_calls: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    ):
        """``timed``: cut every ``every_s`` seconds on its own (an async job); else only when
        :meth:`cut` is called (a sync job cuts at a round's end). ``recovers``: each segment
        holds a recovery section too (:mod:`paramserver.changelog.recover`), with the server's
        books as ``books()`` gives them at the cut. ``between_calls``: held around a timed cut
        (a :class:`~paramserver.server.gate.CallGate`'s ``cut``)."""
        self.store, self.every_s, self.codec = store, every_s, codec
        self.writer = LogWriter(root, writer, store.server, keep)
        rebase = self._rebased()
        self.collector = attach_collector(store, recovers)
        self.books, self.recovers = books, recovers
        self.between_calls = between_calls
        # Each trainer's newest call that a written segment covers, and that a segment written
        # after it covers too: a damaged newest segment still loses none of the latter.
        self._written_calls: dict[int, int] = {}
        self.released_calls: dict[int, int] = {}
        self.stats = PublishStats()
        self._next_step = store.clock + 1
        self._cut_lock = threading.Lock()
        self._waiting: deque[Segment] = deque()
        if rebase:
            self._queue_full(aligned=not timed)  # a resumed sync job's servers start at one step
        self._wake = threading.Condition()
        self._closing = self._close_started = False
        self._give_up_at = float("inf")  # when closing: the time to stop trying
        self._stalled = False  # the first segment in line failed to write: cut no more
        # A cut raised after taking the changes it held: the next is full, so none is lost.
        self._cut_failed = False
        self._timed = timed
        self._last_cut = time.monotonic()
        self._thread = threading.Thread(
            target=self._run, name=f"publisher-{store.server}", daemon=True
        )
        self._thread.start()

    def _rebased(self) -> bool:
        """Whether the store does not continue its chain where it ends (a job resumed from an
        earlier or a later checkpoint, or onto another server count, or a recovered server
        whose last segment was damaged): then a full segment goes first, and its changes are
        numbered on after the log's (see paramserver.changelog.log)."""
        changes = self.store.changes
        rebase = changes.resharded or self.writer.last_changes != changes.covered()
        if rebase:
            changes.continue_from(self.writer.last_changes)
        return rebase

    def _queue_full(self, *, aligned: bool) -> None:
        full = full_cut(self.store, self.collector, self._next_step, self.store.clock)
        full.aligned = aligned
        self._with_books(full)
        self._waiting.append(full)

    def keep_after(self, changes: int) -> None:
        """Keep every segment that ends after store change ``changes`` (the newest committed
        checkpoint's), however many: serving and recovery replay from there."""
        self.writer.keep_after = changes

    def released_through(self, trainer: int) -> int:
        """``trainer``'s newest call that two written segments cover (-1: none): a trainer
        keeps its later calls to send again to this server restarted (see
        :mod:`paramserver.changelog.recover`)."""
        return self.released_calls.get(trainer, -1)

    def due(self) -> bool:
        """Whether a period has passed since the last cut."""
        return time.monotonic() - self._last_cut >= self.every_s

    def cut(self, last_step: int | None = None, *, aligned: bool = False) -> None:
        """Cut what changed up to now, covering the steps up to ``last_step`` (by default the
        store's clock), and queue it for writing; ``aligned``: at a sync round's end that
        every server cuts at."""
        self._cut(last_step, aligned)

    def _cut(self, last_step: int | None, aligned: bool, closing: bool = False) -> None:
        with self._cut_lock:  # taken and queued in one step: segments queue in their order
            if self._stalled and not closing:
                return  # its changes go in the first cut after the writing recovers
            # No step since the last cut: the segment covers none (first = last + 1).
            last = max(self.store.clock if last_step is None else last_step, self._next_step - 1)
            cutter = full_cut if self._cut_failed else cut
            segment = cutter(self.store, self.collector, self._next_step, last)
            self._cut_failed = False
            self._with_books(segment)
            segment.aligned = aligned
            self._next_step = last + 1
            self._last_cut = time.monotonic()
            with self._wake:
                self._waiting.append(segment)
                self._wake.notify()

    def _with_books(self, segment: Segment) -> None:
        if segment.recovery is not None and self.books is not None:
            segment.recovery.books = self.books()

    def flush(self, timeout: float) -> bool:
        """Wait until every segment cut so far is written (False: not within ``timeout``)."""
        with self._wake:
            return self._wake.wait_for(lambda: not self._waiting, timeout)

    def close(self, timeout: float = 60.0) -> None:
        """A last cut, every segment written (within ``timeout`` seconds), the store let go.
        Again: nothing."""
        with self._wake:
            if self._close_started:
                return
            self._close_started = True
        self.store.changes.attach(None)  # first: every change before it is in the last cut
        self._cut(None, not self._timed, closing=True)  # a sync job's servers end at one round
        with self._wake:
            self._closing = True
            self._give_up_at = time.monotonic() + timeout
            self._wake.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():  # it may still write: the chain stays this process's
            logger.error(
                "server %d: %d change log segments not written after %.0f s",
                self.store.server, len(self._waiting), timeout,
            )  # fmt: skip
        else:
            self.writer.close()

    def _run(self) -> None:
        while True:
            with self._wake:
                if not self._waiting and not self._closing:
                    self._wake.wait(self._until_next_cut())
                closing, segment = self._closing, self._waiting[0] if self._waiting else None
            if segment is not None:
                if not self._write(segment):
                    if time.monotonic() >= self._give_up_at:
                        return
                    time.sleep(min(self.every_s, 1.0))
                continue
            if closing:
                return
            if self._timed and self.due():
                self._timed_cut()

    def _timed_cut(self) -> None:
        if not self.collector.has_changes():
            self._last_cut = time.monotonic()  # its steps go in the next segment
            return
        try:
            with self.between_calls():
                self.cut()
        except Exception:  # a bug: training goes on, and the next segment is full
            self.stats.failures += 1
            self._cut_failed = True
            logger.exception("server %d: cutting a change log segment failed", self.store.server)

    def _until_next_cut(self) -> float | None:
        if not self._timed:
            return None
        return max(0.0, self.every_s - (time.monotonic() - self._last_cut))

    def _write(self, segment: Segment) -> bool:
        """Append ``segment`` to the chain (then let it go); False where that failed."""
        start = time.perf_counter()
        try:
            listed = self.writer.append(segment, self.codec)
        except Exception as error:  # a full disk, or a bug: the chain waits, training goes on
            self.stats.failures += 1
            self._stalled = True
            logger.warning("server %d: a change log segment was not written: %r",
                           self.store.server, error)  # fmt: skip
            return False
        self._stalled = False
        if segment.recovery is not None and segment.recovery.books:
            calls = {int(t): int(c) for t, c in segment.recovery.books["calls"].items()}
            self.released_calls, self._written_calls = self._written_calls, calls
        with self._wake:
            self._waiting.popleft()
            self._wake.notify_all()  # a flush waits for the line to empty
        self.stats.segments += 1
        self.stats.rows += segment.num_rows
        self.stats.removed += segment.num_removed
        self.stats.bytes += listed.size
        self.stats.write_seconds += time.perf_counter() - start
        return True
