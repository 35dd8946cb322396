"""Faults a job survives or reports: a killed trainer, a killed server."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

import paramserver as ps
from tests.helpers import TinyRecModel, mse, tiny_batches
from tests.procs import children_of_launcher


def dying_at(step: int, victim: int = 1) -> Any:
    """Data whose trainer ``victim`` SIGKILLs its own process at ``step``."""

    def data(trainer: int, num_trainers: int) -> Iterator[Any]:
        for index, batch in enumerate(tiny_batches(trainer, num_batches=30)):
            if trainer == victim and index == step:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.01)
            yield batch

    return data


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_killed_trainer_is_left_out_and_the_job_finishes(mode: str) -> None:
    step = random.Random(mode).randrange(2, 20)
    config = ps.TrainConfig(
        servers=2, trainers=3, mode=mode, optimizer="sgd", lr=0.05, launcher="processes",
        progress=False, heartbeat_interval=0.2, trainer_timeout=2.0,
    )  # fmt: skip
    result = ps.train(TinyRecModel, dying_at(step), mse, config)
    summary = result.summary
    assert summary["departed_trainers"] == [1]
    assert len(summary["trainer_steps"]) == 2  # the survivors' reports
    assert summary["trainer_steps"] == [30, 30]
    assert children_of_launcher(os.getpid()) == []
