"""Held-out evaluation: AUC (torchmetrics' exact BinaryAUROC) and log loss."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics.classification import BinaryAUROC

from paramserver.trainer.replica import Inputs, as_tuple


@torch.no_grad()
def evaluate_binary(model: nn.Module, batches: Iterable[tuple[Inputs, Tensor]]) -> dict[str, float]:
    """AUC and mean log loss of ``model``'s logits over ``batches``."""
    was_training = model.training
    model.eval()
    auroc = BinaryAUROC()
    loss_sum, count = 0.0, 0
    for inputs, target in batches:
        logits = model(*as_tuple(inputs))
        auroc.update(logits.sigmoid(), target.long())
        loss_sum += float(F.binary_cross_entropy_with_logits(logits, target, reduction="sum"))
        count += target.numel()
    model.train(was_training)
    return {"auc": float(auroc.compute()), "logloss": loss_sum / max(count, 1)}


def auc_of_scores(scores: Tensor, labels: Tensor) -> float:
    auroc = BinaryAUROC()
    auroc.update(scores, labels.long())
    return float(auroc.compute())
