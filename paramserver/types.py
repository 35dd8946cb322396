"""The public shapes of what a user hands to :func:`paramserver.train`, and of what a job reports
back while it runs. Every layer speaks these, so they belong to none of the roles.

- ``model_fn() -> nn.Module`` (:data:`ModelFn`) builds the model; every process calls it under
  the same seeds (:func:`paramserver.modelplan.seeded_model`), so all build the same values.
- ``data_fn(trainer, num_trainers)`` (:data:`DataFn`) yields this trainer's ``(inputs,
  target)`` batches; ``inputs`` (:data:`Inputs`) is one tensor or a tuple or list of them,
  passed to the model's forward as positional arguments (:func:`as_tuple`). An iterable that
  counts the bytes of input it has read in an ``input_bytes`` attribute (an int, as
  :class:`paramserver.data.criteo.CriteoBatches` does) has them reported in the job summary.
- ``loss_fn(outputs, target) -> Tensor`` (:data:`LossFn`) gives the scalar loss.
- ``loop_fn(ctx)`` (:data:`LoopFn`) is a training loop of the user's own
  (:func:`paramserver.run`).
- :class:`Progress` is what a trainer reports as it goes (``on_progress`` callbacks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

Inputs = Tensor | tuple[Tensor, ...] | list[Tensor]
Batch = tuple[Inputs, Tensor]
ModelFn = Callable[[], nn.Module]
DataFn = Callable[[int, int], Iterable[Batch]]
LossFn = Callable[[Any, Tensor], Tensor]
LoopFn = Callable[[Any], Any]
"""``loop_fn(ctx)``: a trainer's training loop (``ctx`` a
:class:`paramserver.trainer.context.TrainContext`); the chief's return value is the result's."""


@dataclass
class Progress:
    """One trainer's progress so far: its steps and samples, and its last step's loss."""

    trainer: int
    steps: int
    samples: int
    loss: float
    lag: int | None = None  # how far its input's head is ahead of it (a stream's), if known
    lag_unit: str = ""  # what ``lag`` counts: "records", "files"


def as_tuple(inputs: Inputs) -> tuple[Tensor, ...]:
    """A batch's inputs as the model's positional arguments."""
    return tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)
