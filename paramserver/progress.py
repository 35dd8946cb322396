"""Job progress for people: a tqdm bar on a terminal, periodic log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

from paramserver.types import Progress

log = logging.getLogger("paramserver")


class ProgressDisplay:
    """Aggregates trainers' progress events: steps (all trainers), samples/s, recent loss."""

    def __init__(
        self, total_steps: int | None, interactive: bool | None = None, log_every_s: float = 10.0
    ):
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self.log_every_s = log_every_s
        self.latest: dict[int, Progress] = {}
        self.started = time.monotonic()
        self.last_log = self.started
        self.bar = (
            tqdm(total=total_steps, unit="step", dynamic_ncols=True, file=sys.stderr)
            if self.interactive
            else None
        )

    def __call__(self, progress: Progress) -> None:
        self.latest[progress.trainer] = progress
        steps = sum(p.steps for p in self.latest.values())
        samples = sum(p.samples for p in self.latest.values())
        rate = samples / max(time.monotonic() - self.started, 1e-9)
        loss = sum(p.loss for p in self.latest.values()) / len(self.latest)
        figures = f"{rate:,.0f} samples/s  loss {loss:.4f}"
        lags = [p for p in self.latest.values() if p.lag is not None]
        if lags:  # a stream: its records, and how far behind its head the trainers are
            lag = max(p.lag for p in lags if p.lag is not None)
            figures = f"{rate:,.0f} records/s  loss {loss:.4f}  lag {lag:,} {lags[0].lag_unit}"
        if self.bar is not None:
            self.bar.update(steps - self.bar.n)
            self.bar.set_postfix_str(figures)
        elif time.monotonic() - self.last_log >= self.log_every_s:
            self.last_log = time.monotonic()
            log.info("step %d  %s", steps, figures)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
