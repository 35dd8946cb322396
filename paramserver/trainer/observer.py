"""What a trainer observes while it trains, beside the training itself.

- every ``metrics_every`` steps, a record of its loss, samples/s, bytes per step each way and
  each group's learning rate (``lr/dense``, ``lr/TABLE``: the rate its last step's gradients
  are applied at, from the config's schedules) in ``--run-dir``; the chief also records each
  server's load (pushes, rows, share of time spent updating and reading, mean staleness of the
  gradients it applied) from the servers' cumulative counters;
- every ``consistency_every`` steps, a check of its dense replica against the servers (see
  :mod:`paramserver.observe.consistency`);
- on the chief, every ``eval_every`` steps or ``eval_every_s`` seconds, the held-out metrics
  of the model as its replica holds it: it reads the rows the held-out batches touch (reads
  that change nothing on the servers) and uses the dense values of its current step
  (``train()`` then scores the final model where it gathers it);
- a ``torch.profiler`` trace of ``profile_steps`` steps from step ``profile_start``.

Everything here runs between steps, after the step's gradients were taken, so none of it can
change what the trainer pushes.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.futures import Future

from paramserver.config import ObserveSection
from paramserver.futures import wait_all
from paramserver.metrics import Evaluation
from paramserver.observe.consistency import Divergence, checksum, compare, summarize_checks
from paramserver.observe.runlog import RunLog
from paramserver.optimconfig import LearningRates
from paramserver.trainer.client import PSClient, Pulled
from paramserver.trainer.replica import Call, Inputs, Replica
from paramserver.transport.stub import ServerStub

log = logging.getLogger(__name__)

PROFILE_DIR = "profile"


class Observer:
    def __init__(
        self,
        trainer: int,
        settings: ObserveSection,
        client: PSClient,
        replica: Replica,
        evaluation: Evaluation | None,
        alarm: Future,
        steps: int = 0,
        samples: int = 0,
        *,
        learning_rates: LearningRates,
        one_process: bool = False,
    ):
        """``steps`` and ``samples``: where the trainer starts (after a resume, not 0);
        ``learning_rates``: each group's rule, for the rates it records; ``one_process``: the
        trainers share this process (the threads launcher), and its one profiler."""
        self.trainer = trainer
        self.settings = settings
        self.learning_rates = learning_rates
        self.client = client
        self.replica = replica
        self.alarm = alarm
        self.chief = trainer == 0
        self.evaluation = evaluation if self.chief and settings.evaluates_while_training else None
        self._evaluated_at = time.monotonic()
        self.evals: list[dict[str, float]] = []  # the chief's: {"step": ..., metric: ...}
        self.checks: list[Divergence] = []
        run_dir = settings.run_dir
        board = settings.tensorboard
        self.log = RunLog(run_dir, f"trainer-{trainer}", board, steps) if run_dir else None
        self.server_logs = (
            [RunLog(run_dir, f"server-{s}", board, steps) for s in range(client.plan.num_servers)]
            if run_dir and self.chief
            else []
        )
        self._mark = self._marks(steps, samples)
        # Servers' counters start at zero with the job (or are read first from now).
        self._server_marks = [{"time": self._mark["time"]} for _ in self.server_logs]
        self._losses: list[float] = []
        self._profiler: Any = None
        # The profiler is per process: under the threads launcher only the chief's runs.
        self._profiles = bool(settings.profile_steps) and (self.chief or not one_process)
        if self._profiles and settings.profile_start <= steps < settings.profile_start + (
            settings.profile_steps
        ):  # from the start, or resumed inside the profiled steps
            self._start_profiler()

    def after_step(self, steps: int, samples: int, loss: float, pulled: Pulled) -> None:
        settings = self.settings
        self._losses.append(loss)
        if self._profiler is not None and steps == settings.profile_start + settings.profile_steps:
            self._stop_profiler()
        elif self._profiles and steps == settings.profile_start:
            self._start_profiler()
        if steps % settings.metrics_every == 0:
            self._record(steps, samples)
        if settings.consistency_every and steps % settings.consistency_every == 0:
            self._check(steps, pulled)
        if self.evaluation is not None and self._evaluation_due(steps):
            self._evaluate(steps)

    def finish(self, steps: int, samples: int) -> dict[str, float]:
        """Record what the last interval saw and close; returns the consistency summary for
        the trainer's report. (The final model is evaluated where it is gathered.)"""
        if self._profiler is not None:
            self._stop_profiler()
        if self._losses:
            self._record(steps, samples)
        self.close()
        return summarize_checks(self.checks)

    def close(self) -> None:
        """Stop the profiler (without a trace) and close the logs; again is a no-op."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        for run_log in [self.log, *self.server_logs]:
            if run_log is not None:
                run_log.close()

    # ---- records ----

    def _marks(self, steps: int, samples: int) -> dict[str, float]:
        sent, received = self.client.wire_bytes()
        return {
            "time": time.perf_counter(),
            "steps": steps,
            "samples": samples,
            "sent": sent,
            "received": received,
        }

    def _record(self, steps: int, samples: int) -> None:
        if self.log is None:
            self._losses.clear()
            return
        mark, self._mark = self._mark, self._marks(steps, samples)
        seconds = max(self._mark["time"] - mark["time"], 1e-9)
        done = max(steps - mark["steps"], 1)
        self.log.write(
            "train",
            steps,
            {
                "loss": sum(self._losses) / max(len(self._losses), 1),
                "samples_per_s": (samples - mark["samples"]) / seconds,
                "steps_per_s": (steps - mark["steps"]) / seconds,
                "push_bytes_per_step": (self._mark["sent"] - mark["sent"]) / done,
                "pull_bytes_per_step": (self._mark["received"] - mark["received"]) / done,
                **self._learning_rates(steps),
            },
        )
        self._losses.clear()
        if self.server_logs:
            self._record_servers(steps)

    def _learning_rates(self, steps: int) -> dict[str, float]:
        """``lr/GROUP``: the rate of each group at the last step done (``steps - 1``, the
        step the schedule gives its gradients; see :mod:`paramserver.schedule`)."""
        rates = self.learning_rates.at(max(steps - 1, 0), self.client.plan.tables)
        return {f"lr/{group}": lr for group, lr in rates.items()}

    def _record_servers(self, steps: int) -> None:
        transport = self.client.transport
        loads: list[dict[str, float]] = wait_all(  # type: ignore[assignment]
            ServerStub(transport).load(), self.alarm
        )
        now = time.perf_counter()
        for server, (load, run_log) in enumerate(zip(loads, self.server_logs, strict=True)):
            before = self._server_marks[server]
            seconds = max(now - before["time"], 1e-9)

            def delta(key: str, load: dict[str, float] = load, before: dict = before) -> float:
                return load[key] - before.get(key, 0)

            gradients = delta("gradients")
            run_log.write(
                "server",
                steps,
                {
                    "pushes_per_s": delta("pushes") / seconds,
                    "rows_updated_per_s": delta("rows_updated") / seconds,
                    "rows_pulled_per_s": delta("rows_pulled") / seconds,
                    "update_time_share": delta("update_seconds") / seconds,
                    "read_time_share": delta("read_seconds") / seconds,
                    "mean_staleness": delta("staleness_sum") / gradients if gradients else 0.0,
                    "bytes_received_per_s": delta("bytes_received") / seconds,
                    "bytes_sent_per_s": delta("bytes_sent") / seconds,
                },
            )
            self._server_marks[server] = {**load, "time": now}

    # ---- checks, evaluation, profile ----

    def _check(self, steps: int, pulled: Pulled) -> None:
        plan = self.client.plan
        dense = self.replica.dense
        asked: list[dict[str, str]] = [{} for _ in range(plan.num_servers)]
        for name, server in plan.dense_server.items():
            asked[server][name] = checksum(dense[name])
        answers = wait_all(
            [ServerStub(self.client.transport).dense_check(s, a) for s, a in enumerate(asked)],
            self.alarm,
        )
        views = {name: view for answer in answers for name, view in answer.items()}  # type: ignore[attr-defined]
        divergence = compare(dict(dense), pulled.dense_versions, views)
        self.checks.append(divergence)
        if self.log is not None:
            self.log.write("consistency", steps, divergence.as_record())

    def _evaluation_due(self, steps: int) -> bool:
        every, every_s = self.settings.eval_every, self.settings.eval_every_s
        return (every is not None and steps % every == 0) or (
            every_s is not None and time.monotonic() - self._evaluated_at >= every_s
        )

    def _evaluate(self, steps: int) -> None:
        assert self.evaluation is not None
        self._evaluated_at = time.monotonic()
        replica, client = self.replica, self.client

        def forward(inputs: Inputs) -> Tensor:
            return replica.look(Call.of(inputs), client.pull)

        with client.transport.profiled_as("eval"):  # not the training's traffic
            metrics = self.evaluation.score(replica.model, forward)
        self.evals.append({"step": steps, **metrics})
        if self.log is not None:
            self.log.write("eval", steps, metrics)
        log.info(
            "trainer %d, step %d: held-out %s",
            self.trainer,
            steps,
            "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()),
        )

    def _start_profiler(self) -> None:
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._profiler.start()

    def _stop_profiler(self) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        assert self.settings.run_dir is not None  # validated with profile_steps
        directory = Path(self.settings.run_dir) / PROFILE_DIR
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"trainer-{self.trainer}.json"
        profiler.export_chrome_trace(str(path))
        log.info("trainer %d: profiler trace written to %s", self.trainer, path)
