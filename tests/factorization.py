"""A small factorization model and its batches, trained under each update rule: the
shared ground of the tests of prefetch with own updates and of grouped steps.

The model, its batches and the rules are benchmarks/small_models.py's; the state digests
(benchmarks/state_digest.py) train under the same rules, so a rule changed reaches both."""

from __future__ import annotations

from typing import Any

from torch import Tensor

import paramserver as ps
from benchmarks.small_models import NUM_STEPS, RULES, Factorization, mse
from benchmarks.small_models import factorization_batches as batches

__all__ = ["NUM_STEPS", "RULES", "Factorization", "batches", "train"]


def train(rule: str, dynamic: bool = False, servers: int = 2, **options: Any) -> dict[str, Tensor]:
    config = ps.TrainConfig(
        servers=servers, trainers=1, mode="async", launcher="threads", progress=False,
        seed=3, **RULES[rule], **options,
    )  # fmt: skip
    result = ps.train(lambda: Factorization(dynamic), lambda rank, _: batches(rank), mse, config)
    assert result is not None and result.model is not None
    return result.model.state_dict()
