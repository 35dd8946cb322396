"""Every change to a store's rows and dense values, numbered in one order: the seam that a
change log (rows to publish to serving) and recovery by replay build on.

A store's tables and dense values report each change once it is made: rows written (updated
by a push, created by a dynamic table's admission, set by a restore or a replay), ids removed
(a dynamic table's eviction and expiry, or a delete), dense values written; and, for recovery,
what a training read changes of a dynamic table besides values: rows touched (their last
touch, which expiry and eviction go by) and pending ids counted or forgotten (admission).
Each report takes the store's next sequence number, so the numbers order the changes of one
server; an observer attached (:meth:`ChangeFeed.attach`) is called with it, under the feed's
lock, so it sees them in that order. One operation over several tables (an update of all a
push's tables, the rows a read made) is one report: one number, told to the observer table by
table. With no observer a report costs one lock and one addition (and the reports only
recovery needs are not made: :attr:`ChangeFeed.recovering`).

What a report names: a table and the ids whose rows changed (global row ids of a fixed table,
the ids themselves of a dynamic one), or dense parameters by name; not the values, which an
observer reads when it needs them (a change log reads the latest value of a row once per cut,
however often it changed).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Protocol

from torch import Tensor


class ChangeObserver(Protocol):
    """Told of every change to a store, in order (see the module doc). Called under the feed's
    lock from the thread that made the change: it must be quick and must not call the store.
    The ids given are the caller's: an observer that keeps them copies them."""

    def rows_written(self, table: str, ids: Tensor, sequence: int) -> None: ...

    def ids_removed(self, table: str, ids: Tensor, sequence: int) -> None: ...

    # Whether it is told of touches and pending ids (rows_touched, pending_changed), which
    # only recovery needs: a read makes those reports only for such an observer.
    recovers: bool

    def dense_written(self, names: Sequence[str], sequence: int) -> None: ...

    def rows_touched(self, table: str, ids: Tensor, sequence: int) -> None: ...

    def pending_changed(self, table: str, ids: Tensor, sequence: int) -> None: ...


class ChangeFeed:
    """A store's changes, numbered (:attr:`sequence`: the number of the last one, 0 before
    any), told to the observer attached, if any."""

    def __init__(self) -> None:
        self.sequence = 0
        self.observer: ChangeObserver | None = None
        # Restored from parts of another shard layout (or several servers' parts): its rows
        # are not its own server's of before, whatever its sequence says.
        self.resharded = False
        self._lock = threading.Lock()

    def attach(self, observer: ChangeObserver | None) -> int:
        """From the next change on, tell ``observer`` (None: no one); returns the number of
        the last change it is not told of."""
        with self._lock:
            self.observer = observer
            return self.sequence

    def restored(self, sequence: int, *, resharded: bool) -> None:
        """A restore (no observer attached) made the store what a snapshot that covered
        change ``sequence`` held: its own writes were no changes, the next is numbered after
        ``sequence``."""
        with self._lock:
            assert self.observer is None, "a store is restored before it is observed"
            self.sequence, self.resharded = sequence, resharded

    def continue_from(self, sequence: int) -> None:
        """Number the next change after ``sequence`` at least (a store restored from a
        snapshot that covered it)."""
        with self._lock:
            self.sequence = max(self.sequence, sequence)

    def rows_written(self, rows: Mapping[str, Tensor]) -> None:
        """The rows of ids ``rows[table]`` written by one operation (the caller has checked
        that some are): one number, the observer told of each table with ids."""
        with self._lock:
            self.sequence += 1
            if self.observer is not None:
                for table, ids in rows.items():
                    if ids.numel():
                        self.observer.rows_written(table, ids, self.sequence)

    def ids_removed(self, table: str, ids: Tensor) -> None:
        self._told("ids_removed", table, ids)

    def dense_written(self, names: Sequence[str]) -> None:
        if names:
            with self._lock:
                self.sequence += 1
                if self.observer is not None:
                    self.observer.dense_written(names, self.sequence)

    @property
    def recovering(self) -> bool:
        """Whether the observer attached records for recovery: the reports only it needs
        (touches, pending ids) are made only then, so they cost a read nothing otherwise."""
        observer = self.observer
        return observer is not None and observer.recovers

    def rows_touched(self, table: str, ids: Tensor) -> None:
        """The rows of ``ids`` were touched by a training read (their last touch changed)."""
        self._told("rows_touched", table, ids)

    def pending_changed(self, table: str, ids: Tensor) -> None:
        """The pending ids ``ids`` were counted by a training read, or forgotten."""
        self._told("pending_changed", table, ids)

    def _told(self, event: str, table: str, ids: Tensor) -> None:
        if ids.numel():
            with self._lock:
                self.sequence += 1
                if self.observer is not None:
                    getattr(self.observer, event)(table, ids, self.sequence)

    def covered(self) -> int:
        """The number of the last change made so far."""
        with self._lock:
            return self.sequence
