"""Held-out evaluation: a metric function maps a model's outputs and targets to named values.

``binary_metrics`` (AUC with torchmetrics' exact BinaryAUROC, and log loss) suits click models
that output logits; ``regression_metrics`` (RMSE and MAE) suits rating models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from paramserver.errors import ConfigError
from paramserver.types import Inputs, as_tuple

MetricFn = Callable[[Tensor, Tensor], dict[str, float]]


def binary_metrics(logits: Tensor, targets: Tensor) -> dict[str, float]:
    return {
        "auc": auc_of_scores(logits.sigmoid(), targets),
        "logloss": float(F.binary_cross_entropy_with_logits(logits, targets.float())),
    }


def regression_metrics(predictions: Tensor, targets: Tensor) -> dict[str, float]:
    errors = predictions.float() - targets.float()
    return {"rmse": float(errors.square().mean().sqrt()), "mae": float(errors.abs().mean())}


def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[Inputs, Tensor]],
    metric_fn: MetricFn,
    forward: Callable[[Inputs], Tensor] | None = None,
) -> dict[str, float]:
    """``metric_fn`` of ``model``'s outputs over all ``batches``, in eval mode, without
    gradients; ``forward(inputs)`` computes them (default: ``model(*inputs)``)."""
    was_training = model.training
    model.eval()
    outputs, targets = [], []
    try:
        with torch.no_grad():
            for inputs, target in batches:
                outputs.append(forward(inputs) if forward else model(*as_tuple(inputs)))
                targets.append(target)
    finally:
        model.train(was_training)
    if not outputs:
        raise ConfigError("evaluation: the held-out data yielded no batches")
    return metric_fn(torch.cat(outputs), torch.cat(targets))


@dataclass(frozen=True)
class Evaluation:
    """Held-out data and how to score it: ``data_fn()`` yields ``(inputs, target)`` batches;
    ``metric_fn(outputs, targets)`` maps all outputs and targets to named values."""

    data_fn: Callable[[], Iterable[tuple[Inputs, Tensor]]]
    metric_fn: MetricFn

    def score(
        self, model: nn.Module, forward: Callable[[Inputs], Tensor] | None = None
    ) -> dict[str, float]:
        """:func:`evaluate` of ``model`` on this held-out data."""
        return evaluate(model, self.data_fn(), self.metric_fn, forward)


def as_summary(metrics: dict[str, float]) -> dict[str, float]:
    """Held-out metrics as job-summary keys (``auc`` is ``eval_auc``)."""
    return {f"eval_{name}": value for name, value in metrics.items()}


def evaluate_binary(model: nn.Module, batches: Iterable[tuple[Inputs, Tensor]]) -> dict[str, float]:
    """AUC and mean log loss of ``model``'s logits over ``batches``."""
    return evaluate(model, batches, binary_metrics)


def auc_of_scores(scores: Tensor, labels: Tensor) -> float:
    # Imported here: torchmetrics (and matplotlib, which it loads) add ~0.5 s to the start of
    # every process, and most never score anything.
    from torchmetrics.classification import BinaryAUROC

    # No sync: in a process with torch.distributed up (DDP, torchrun) it would gather from
    # every rank, and wait for ranks that are not evaluating.
    auroc = BinaryAUROC(sync_on_compute=False)
    auroc.update(scores, labels.long())
    return float(auroc.compute())
