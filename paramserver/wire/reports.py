"""What a trainer reports with its last call: per-operation call statistics (:class:`CallStats`)
and its replica checks' summary (:class:`TrainerReport`). Latencies go into fixed logarithmic
buckets (16 per decade, from 10 us to 1,000 s), so trainers' statistics merge by adding counts
and percentiles are read off the merged histogram: a percentile is reported as its bucket's
geometric middle, within 8% of the true value."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
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


CONSISTENCY_KEYS = frozenset(  # of a trainer's replica-check summary (observe.consistency)
    {
        "checks",
        "versions_behind_max",
        "versions_behind_mean",
        "max_abs_diff",
        "rel_l2_diff_max",
        "differing_at_same_version",
    }
)


@dataclass
class TrainerReport:
    """What a trainer tells the servers when it leaves, for the job summary.

    Its counts and times cover this run: what the trainer did since it started or, after
    ``--resume`` (or a restart), since the checkpoint it resumed from; ``resumed_*`` say where
    that was.
    """

    trainer: int
    steps: int
    samples: int
    train_loss: float
    train_seconds: float
    bytes_sent: int
    bytes_received: int
    uncompressed_bytes_sent: int = 0  # what the same messages would be without codecs
    uncompressed_bytes_received: int = 0
    row_bytes_received: int = 0  # embedding rows alone
    cache_hits: int = 0  # rows served from the trainer's cache...
    cache_lookups: int = 0  # ...of the rows its steps needed from cached tables
    peak_rss_bytes: int = 0  # the trainer process's peak resident memory
    input_bytes: int | None = None  # bytes of input its data read; None: the data does not say
    calls: dict[str, CallStats] = field(default_factory=dict)  # by operation
    consistency: dict[str, float] = field(default_factory=dict)  # replica checks, if any
    resumed_at: int = -1  # the step of the checkpoint this run resumed from; -1: from the start
    resumed_steps: int = 0  # the steps and samples this trainer had done by that checkpoint
    resumed_samples: int = 0
    resent_calls: int = 0  # calls sent again to servers restarted after their process died
    paused_s: float = 0.0  # the time its calls waited for those servers
    # A stream's position after its last step (JSON text), for the job's final checkpoint.
    input_position: str | None = None

    def is_well_formed(self) -> bool:
        ints = (
            self.trainer,
            self.steps,
            self.samples,
            self.bytes_sent,
            self.bytes_received,
            self.uncompressed_bytes_sent,
            self.uncompressed_bytes_received,
            self.row_bytes_received,
            self.cache_hits,
            self.cache_lookups,
            self.peak_rss_bytes,
            self.resumed_at,
            self.resumed_steps,
            self.resumed_samples,
            self.resent_calls,
        )
        floats = (self.train_loss, self.train_seconds, self.paused_s)
        return (
            all(type(v) is int for v in ints)
            and (self.input_bytes is None or type(self.input_bytes) is int)
            and (
                self.input_position is None
                or (type(self.input_position) is str and len(self.input_position) <= 1 << 16)
            )
            and all(type(v) is float for v in floats)
            and type(self.calls) is dict
            and all(
                type(op) is str and type(c) is CallStats and c.is_well_formed()
                for op, c in self.calls.items()
            )
            and type(self.consistency) is dict
            and (not self.consistency or set(self.consistency) == CONSISTENCY_KEYS)
            and all(type(v) in (int, float) for v in self.consistency.values())
        )
