"""Serving's Prometheus metrics, in the text exposition format (``GET /metrics``).

- ``paramserver_served_version``: the served version's number, its place in the log (it
  only rises for a given log, across restarts: see
  :attr:`~paramserver.serving.model.Version.number`);
- ``paramserver_served_step{server}``: each training server's last step applied;
- ``paramserver_freshness_seconds``: how long ago the newest change served was cut;
- ``paramserver_segments_total{outcome}``: segments applied and refused;
- ``paramserver_requests_total{protocol,model,outcome}``: requests answered, by outcome
  (``ok``, ``bad_request``, ``not_found``, ``error``);
- ``paramserver_request_seconds{protocol}``: a histogram of request latency.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter

from paramserver.serving.model import Version

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0, 5.0)


class ServingMetrics:
    """The counters and histograms of one serving process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, str, str]] = Counter()
        self.segments: Counter[str] = Counter()
        self._latency: dict[str, list[int]] = {}
        self._latency_sum: dict[str, float] = {}

    def request(self, protocol: str, model: str, outcome: str, seconds: float) -> None:
        with self._lock:
            self.requests[(protocol, model, outcome)] += 1
            buckets = self._latency.setdefault(protocol, [0] * (len(LATENCY_BUCKETS) + 1))
            buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            self._latency_sum[protocol] = self._latency_sum.get(protocol, 0.0) + seconds

    def segments_done(self, applied: int, refused: int) -> None:
        with self._lock:
            self.segments["applied"] += applied
            self.segments["refused"] += refused

    def text(self, version: Version) -> str:
        """Every metric in the text format, with ``version`` the one served now."""
        lines = [
            "# TYPE paramserver_served_version gauge",
            f"paramserver_served_version {version.number}",
            "# TYPE paramserver_served_step gauge",
            *(
                f'paramserver_served_step{{server="{s}"}} {step}'
                for s, step in version.steps.items()
            ),
            "# TYPE paramserver_freshness_seconds gauge",
            f"paramserver_freshness_seconds {_age(version):.6f}",
        ]
        with self._lock:
            lines.append("# TYPE paramserver_segments_total counter")
            lines += [
                f'paramserver_segments_total{{outcome="{k}"}} {n}'
                for k, n in sorted(self.segments.items())
            ]
            lines.append("# TYPE paramserver_requests_total counter")
            for (protocol, model, outcome), n in sorted(self.requests.items()):
                labels = f'protocol="{protocol}",model="{_escaped(model)}",outcome="{outcome}"'
                lines.append(f"paramserver_requests_total{{{labels}}} {n}")
            lines.append("# TYPE paramserver_request_seconds histogram")
            for protocol, buckets in sorted(self._latency.items()):
                lines += _histogram(protocol, buckets, self._latency_sum[protocol])
        return "\n".join(lines) + "\n"


def _histogram(protocol: str, buckets: list[int], total: float) -> list[str]:
    name, lines, seen = "paramserver_request_seconds", [], 0
    for bound, count in zip((*LATENCY_BUCKETS, float("inf")), buckets, strict=True):
        seen += count
        le = "+Inf" if bound == float("inf") else repr(bound)
        lines.append(f'{name}_bucket{{protocol="{protocol}",le="{le}"}} {seen}')
    lines.append(f'{name}_sum{{protocol="{protocol}"}} {total:.6f}')
    lines.append(f'{name}_count{{protocol="{protocol}"}} {seen}')
    return lines


def _age(version: Version) -> float:
    return max(0.0, time.time() - version.applied_at) if version.applied_at else 0.0


def _escaped(label: str) -> str:
    return label.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
