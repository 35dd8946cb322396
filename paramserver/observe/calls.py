"""Per-operation call profiles: how many calls, their bytes, and a latency histogram.

Latencies go into fixed logarithmic buckets (16 per decade, from 10 us to 1,000 s), so
trainers' profiles merge by adding counts and percentiles are read off the merged histogram:
a percentile is reported as its bucket's geometric middle, within 8% of the true value.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field, replace
from typing import Any

BUCKETS_PER_DECADE = 16
SMALLEST_S = 1e-5
NUM_BUCKETS = 8 * BUCKETS_PER_DECADE + 2  # one below 10 us, one at or above 1,000 s


def bucket_of(seconds: float) -> int:
    if seconds < SMALLEST_S:
        return 0
    index = 1 + int(math.log10(seconds / SMALLEST_S) * BUCKETS_PER_DECADE)
    return min(index, NUM_BUCKETS - 1)


def bucket_middle(index: int) -> float:
    """The geometric middle of bucket ``index``, in seconds."""
    if index == 0:
        return SMALLEST_S / 2
    return SMALLEST_S * 10 ** ((index - 0.5) / BUCKETS_PER_DECADE)


@dataclass
class CallStats:
    """One operation's calls (as a trainer made them); travels in the trainer's report."""

    calls: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    max_s: float = 0.0
    histogram: list[int] = field(default_factory=lambda: [0] * NUM_BUCKETS)

    def add(self, seconds: float) -> None:
        self.calls += 1
        self.max_s = max(self.max_s, seconds)
        self.histogram[bucket_of(seconds)] += 1

    def merge(self, other: CallStats) -> None:
        self.calls += other.calls
        self.sent_bytes += other.sent_bytes
        self.received_bytes += other.received_bytes
        self.max_s = max(self.max_s, other.max_s)
        self.histogram = [a + b for a, b in zip(self.histogram, other.histogram, strict=True)]

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile latency in seconds (0 without calls)."""
        timed = sum(self.histogram)
        if not timed:
            return 0.0
        rank = max(1, math.ceil(q / 100 * timed))
        seen = 0
        for index, count in enumerate(self.histogram):
            seen += count
            if seen >= rank:
                return min(bucket_middle(index), self.max_s)
        return self.max_s

    def is_well_formed(self) -> bool:
        return (
            all(type(v) is int and v >= 0 for v in (self.calls, self.sent_bytes))
            and type(self.received_bytes) is int
            and self.received_bytes >= 0
            and type(self.max_s) is float
            and math.isfinite(self.max_s)
            and type(self.histogram) is list
            and len(self.histogram) == NUM_BUCKETS
            and all(type(c) is int and c >= 0 for c in self.histogram)
        )

    def summary(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "sent_bytes": self.sent_bytes,
            "received_bytes": self.received_bytes,
            "p50_ms": self.percentile(50) * 1e3,
            "p90_ms": self.percentile(90) * 1e3,
            "p99_ms": self.percentile(99) * 1e3,
            "max_ms": self.max_s * 1e3,
        }


class CallProfile:
    """Thread-safe: calls complete on RPC threads."""

    def __init__(self) -> None:
        self.ops: dict[str, CallStats] = {}
        self._lock = threading.Lock()

    def sent(self, op: str, nbytes: int) -> None:
        with self._lock:
            self.ops.setdefault(op, CallStats()).sent_bytes += nbytes

    def answered(self, op: str, seconds: float, nbytes: int) -> None:
        with self._lock:
            stats = self.ops.setdefault(op, CallStats())
            stats.add(seconds)
            stats.received_bytes += nbytes

    def bytes_of(self, *ops: str) -> tuple[int, int]:
        """Bytes sent and received so far by calls of ``ops``."""
        with self._lock:
            found = [self.ops[op] for op in ops if op in self.ops]
            return sum(s.sent_bytes for s in found), sum(s.received_bytes for s in found)

    def snapshot(self) -> dict[str, CallStats]:
        with self._lock:
            return {op: replace(s, histogram=list(s.histogram)) for op, s in self.ops.items()}
