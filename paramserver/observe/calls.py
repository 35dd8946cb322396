"""Per-operation call profiles: how many calls, their bytes, and a latency histogram.

A trainer's :class:`CallProfile` fills one :class:`~paramserver.wire.reports.CallStats` per
operation (the record its report carries to the servers, where the job summary merges them).
"""

from __future__ import annotations

import threading
from dataclasses import replace

from paramserver.wire.reports import CallStats


class CallProfile:
    """Thread-safe: calls complete on RPC threads."""

    def __init__(self) -> None:
        self.ops: dict[str, CallStats] = {}
        self._lock = threading.Lock()

    def sent(self, op: str, nbytes: int) -> None:
        with self._lock:
            self._stats(op).sent_bytes += nbytes

    def answered(self, op: str, seconds: float, nbytes: int) -> None:
        with self._lock:
            stats = self._stats(op)
            stats.add(seconds)
            stats.received_bytes += nbytes

    def _stats(self, op: str) -> CallStats:
        """``op``'s record, made at its first call (not a new one at every call, as
        ``setdefault``'s default would be)."""
        stats = self.ops.get(op)
        if stats is None:
            stats = self.ops[op] = CallStats()
        return stats

    def bytes_of(self, *ops: str) -> tuple[int, int]:
        """Bytes sent and received so far by calls of ``ops``."""
        with self._lock:
            found = [self.ops[op] for op in ops if op in self.ops]
            return sum(s.sent_bytes for s in found), sum(s.received_bytes for s in found)

    def snapshot(self) -> dict[str, CallStats]:
        with self._lock:
            return {op: replace(s, histogram=list(s.histogram)) for op, s in self.ops.items()}
