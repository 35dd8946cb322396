"""Serving follows the training servers' change logs: every ``poll_s`` seconds it reads each
server's manifest, takes the segments after the last it applied (each chain checked: see
:mod:`paramserver.changelog.log`), and applies them to the served model as one version.

Which segments make a version: in a sync job each segment is cut at a round every server cut
at (``aligned``), so a version is every server's segments up to the newest step all of them
have reached: the model after that step, exactly; a server ahead waits for the others, and no
version is applied before every server of the job (each segment names how many) has cut. In
an async job a version is each server's newest cut. A server whose chain breaks (a gap, a
duplicate, a damaged file) or whose segment does not fit the served model is reported (logged
once, counted, :attr:`Follower.problems`) and its segments up to the break are still applied;
serving keeps answering from the last good version, and takes that server's chain up again
once it is whole. A follower far behind (a restart replaying a long log) reads a bounded
number of segments per server at a time and applies version after version until it is level.
A log pruned past what the served model needs next is a gap (:meth:`Follower.gaps`): a
serving process does not start on it (see :mod:`paramserver.serving.run`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from paramserver.changelog.log import ChainFollower, servers_under
from paramserver.changelog.segment import Segment
from paramserver.errors import ChangeLogError
from paramserver.serving.metrics import ServingMetrics
from paramserver.serving.model import ServedModel

log = logging.getLogger(__name__)


class Follower:
    """Follows the logs under ``root`` into ``served`` (see the module doc)."""

    def __init__(
        self,
        served: ServedModel,
        root: str | os.PathLike[str],
        metrics: ServingMetrics | None = None,
        poll_s: float = 0.1,
    ):
        self.served, self.root, self.poll_s = served, Path(root), poll_s
        self.metrics = metrics or ServingMetrics()
        self.chains: dict[int, ChainFollower] = {}
        self.problems: dict[int, str] = {}  # each server's last refusal, while it lasts
        # Told of each version applied: its segments and when (time.time()); benchmarks
        # measure freshness with it.
        self.on_applied: Callable[[list[Segment], float], None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="serving-follow", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.catch_up()
            except Exception:  # a bug: keep serving what is applied, say so
                log.exception("following the change logs under %s failed", self.root)

    def catch_up(self) -> None:
        """Poll until level with the logs: a follower behind applies version after version."""
        while self.poll() and any(chain.more for chain in self.chains.values()):
            pass

    def poll(self) -> int:
        """One round of reading and applying one version; returns the segments applied."""
        chosen = _version(self._pending())
        if not any(chosen.values()):
            return 0
        segments = [segment for found in chosen.values() for segment in found]
        self.served.apply(segments, max(s.cut_at for s in segments))
        for server, found in chosen.items():
            if found:
                self.chains[server].applied_up_to(found[-1])
        self.metrics.segments_done(len(segments), 0)
        if self.on_applied is not None:
            self.on_applied(segments, time.time())
        return len(segments)

    def gaps(self) -> dict[int, str]:
        """The servers whose chain no longer holds the segments the served model needs next
        (pruned by their writer: see :meth:`ChainFollower.gap`), each with why. A serving
        process does not start on such a base: what it would serve is not the job's model
        and would never become it."""
        self._add_chains()
        return {server: gap for server, chain in self.chains.items() if (gap := chain.gap())}

    def _add_chains(self) -> None:
        """Follow each server's chain found under the root, from the served base: its place
        in the chain (the last segment it covers whole) is the version's until a segment of
        it is applied."""
        if not self.root.is_dir():
            return
        for server in servers_under(self.root):
            if server not in self.chains:
                covered = self.served.version.changes.get(server, 0)
                chain = self.chains[server] = ChainFollower(self.root, server, covered)
                place = chain.covered_by_base()
                if place is not None and server not in self.served.version.segments:
                    self.served.place_base(server, place.sequence, place.last_step)

    def _pending(self) -> dict[int, list[Segment]]:
        self._add_chains()
        pending = {}
        for server, chain in self.chains.items():
            found, error = chain.pending()
            for at, segment in enumerate(found):
                try:
                    self.served.check(segment)
                except ChangeLogError as unfit:
                    found, error = found[:at], unfit
                    break
            if error is not None:
                self._refused(server, str(error), 1)
            else:
                self.problems.pop(server, None)
            pending[server] = found
        return pending

    def _refused(self, server: int, problem: str, count: int) -> None:
        if self.problems.get(server) != problem:
            log.error("serving refuses server %d's change log: %s", server, problem)
            self.metrics.segments_done(0, count)
        self.problems[server] = problem


def _version(pending: dict[int, list[Segment]]) -> dict[int, list[Segment]]:
    """The segments of ``pending`` that make the next version (see the module doc)."""
    found = [s for segments in pending.values() for s in segments]
    if not found or not all(s.aligned for s in found):
        return pending
    servers = range(max(s.servers for s in found))  # the job's: a resharded job's old stay
    if not all(pending.get(server) for server in servers):
        return {server: [] for server in pending}  # a server has nothing new: wait for it
    step = min(pending[server][-1].last_step for server in servers)
    return {server: _up_to(segments, step) for server, segments in pending.items()}


def _up_to(segments: Sequence[Segment], step: int) -> list[Segment]:
    return [s for s in segments if s.last_step <= step]
