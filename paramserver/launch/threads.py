"""Run a whole job inside this process: servers as objects, trainers as threads.

Same roles and protocol as a multi-process job, over the in-process transport. Used by tests
and handy in notebooks; torch ops release the GIL, so trainers still overlap.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from paramserver.config import TrainConfig
from paramserver.errors import JobFailedError
from paramserver.launch.roles import build_server
from paramserver.metrics import Evaluation
from paramserver.trainer.loop import DataFn, LossFn, ModelFn, Progress, TrainerOutcome, run_trainer
from paramserver.transport.local import LocalTransport


def run_threads(
    config: TrainConfig,
    model_fn: ModelFn,
    data_fn: DataFn,
    loss_fn: LossFn,
    on_progress: Callable[[Progress], None] | None = None,
    evaluation: Evaluation | None = None,
) -> tuple[TrainerOutcome, LocalTransport]:
    """Run the job; returns the chief's outcome and the transport (its servers stay readable)."""
    endpoints = [build_server(s, config, model_fn) for s in range(config.servers)]
    transport = LocalTransport(endpoints)
    outcomes: dict[int, TrainerOutcome] = {}
    errors: dict[int, BaseException] = {}

    def trainer_main(rank: int) -> None:
        try:
            outcomes[rank] = run_trainer(
                rank, config, model_fn, data_fn, loss_fn, transport, on_progress, evaluation
            )
        except BaseException as error:  # reported below, with the trainer's rank
            errors[rank] = error
            # Leave the job so sync rounds and the chief's wait do not hang on this trainer.
            for endpoint in endpoints:
                endpoint.coordinator.remove_trainer(rank)

    threads = [
        threading.Thread(target=trainer_main, args=(r,), name=f"trainer{r}", daemon=True)
        for r in range(config.trainers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        rank, error = min(errors.items())
        raise JobFailedError(f"trainer {rank} failed: {type(error).__name__}: {error}") from error
    return outcomes[0], transport
