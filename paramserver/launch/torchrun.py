"""Running under torchrun: every rank runs the same program; the role comes from ``RANK``.

The first ``--servers`` ranks serve, the others train. ``WORLD_SIZE`` must equal servers plus
trainers. The RPC world meets through torchrun's store (``env://``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from paramserver.config import TrainConfig
from paramserver.errors import ConfigError
from paramserver.launch.roles import ChiefResult, run_rank
from paramserver.launch.worker import die_with_parent
from paramserver.metrics import Evaluation
from paramserver.types import LoopFn, ModelFn, Progress


def run_torchrun_rank(
    config: TrainConfig,
    model_fn: ModelFn,
    loop_fn: LoopFn,
    on_progress: Callable[[Progress], None] | None = None,
    evaluation: Evaluation | None = None,
) -> ChiefResult | None:
    # Die with torchrun's agent: a killed agent must leave no rank behind.
    die_with_parent(os.getppid())
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != config.world_size:
        raise ConfigError(
            f"torchrun started {world_size} ranks but --servers {config.servers} plus --trainers "
            f"{config.trainers} needs {config.world_size}; set --nproc-per-node/--nnodes to match"
        )
    return run_rank(
        rank,
        config,
        model_fn,
        loop_fn,
        init_method="env://",
        loopback_only=False,
        on_progress=on_progress,
        evaluation=evaluation,
    )
