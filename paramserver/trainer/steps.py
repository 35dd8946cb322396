"""A trainer's steps as the context draws them: each step's batches with what they look up
(recorded ahead, where the batches allow), and a group of steps computed from one pull
(``steps_per_call``), with the values each of its steps loads."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from paramserver.errors import ParamServerError
from paramserver.inputs import STOP, PositionedInput
from paramserver.trainer.checkpointing import TrainerCheckpoints
from paramserver.trainer.client import Pulled
from paramserver.trainer.heartbeat import Activity
from paramserver.trainer.lookups import RecordedLookups
from paramserver.trainer.replica import Call, Replica
from paramserver.wire.messages import BagBlock

log = logging.getLogger(__name__)


@dataclass
class Step:
    """One step's batches and what they look up (``ids`` None: not recorded ahead)."""

    batches: list[Any]
    ids: dict[str, Tensor] | None = None
    bags: dict[str, BagBlock] = field(default_factory=dict)
    lookups: dict[str, RecordedLookups] = field(default_factory=dict)
    end: Any = None  # a positioned input's position after these batches (None: not one)


@dataclass
class Group:
    """Steps computed from one pull (``steps_per_call``): what they look up together, and
    once the answer is in, the values each step loads, with each step's own update applied
    to them before the next (see :class:`~paramserver.trainer.context.TrainContext`)."""

    steps: list[Step]
    ids: dict[str, Tensor]  # per table: the ids any step looks up, sorted unique
    masks: dict[str, Tensor]  # per table: those two steps or more look up, whose state to ask
    places: list[dict[str, Tensor]]  # per step and table: where its ids are in ``ids``
    values: Pulled | None = None  # the answer, updated step by step
    at: int = 0  # the step computing

    @classmethod
    def of(cls, steps: list[Step]) -> Group:
        ids, masks = {}, {}
        places: list[dict[str, Tensor]] = [{} for _ in steps]
        for name in {name for step in steps for name in step.ids or {}}:
            looked_up = [
                (i, step.ids[name]) for i, step in enumerate(steps) if step.ids and name in step.ids
            ]
            joined = torch.cat([each for _, each in looked_up]).numpy()
            union, inverse, counts = np.unique(joined, return_inverse=True, return_counts=True)
            ids[name], masks[name] = torch.from_numpy(union), torch.from_numpy(counts > 1)
            ends = np.cumsum([each.numel() for _, each in looked_up])
            for (i, _), at in zip(looked_up, np.split(inverse, ends[:-1]), strict=True):
                places[i][name] = torch.from_numpy(at)
        return cls(steps, ids, masks, places)

    def step_values(self, at: int) -> Pulled:
        """What step ``at`` of the group loads: its rows of the values, and the dense ones."""
        values = self.values
        assert values is not None
        step = self.steps[at]
        rows = {
            name: (ids, values.rows[name][1].index_select(0, self.places[at][name]))
            for name, ids in (step.ids or {}).items()
        }
        # Its dense values are the answer's with the group's earlier steps' updates.
        versions = {name: version + at for name, version in values.dense_versions.items()}
        return Pulled(
            values.dense,
            rows,
            call=values.call,
            checkpoint_at=values.checkpoint_at,
            dense_versions=versions,
        )


class AheadRecorder:
    """Draws the next step's batches and records what they look up, where it can."""

    def __init__(
        self,
        replica: Replica,
        activity: Activity,
        groups: Iterator[list[Any]],
        inputs: Callable[[Any], Any] | None,
        positioned: PositionedInput | None = None,
    ):
        self.replica = replica
        self.activity = activity
        self.groups = groups
        self.positioned = positioned
        self.inputs = inputs
        self.guessing = inputs is None

    def next(self) -> Step | None:
        group = next(self.groups, None)
        self.activity.touch()  # a batch drawn: the loop is not stuck in its data
        if group is None:
            return None
        end = self.positioned.position() if self.positioned is not None else None
        step = self._recorded(group)
        step.end = end
        return step

    def _recorded(self, group: list[Any]) -> Step:
        calls = self._calls(group)
        if calls is None:
            return Step(group)
        try:
            recorded = self.replica.record(calls)
        except ParamServerError:
            raise
        except Exception as error:  # a guess at the model's arguments failed
            if not self.guessing:
                raise
            log.info(
                "looking ahead at a step's lookups by calling the model on each batch's first "
                "element failed (%s: %s): either the batches are not (inputs, target) pairs "
                "or the model fails on them (the step will show it); rows are read on demand",
                type(error).__name__,
                error,
            )
            self.inputs, self.guessing = None, False
            return Step(group)
        return Step(group, *recorded)

    def _calls(self, group: list[Any]) -> list[Call] | None:
        if self.inputs is not None:
            return [Call.of(self.inputs(batch)) for batch in group]
        if self.guessing and all(isinstance(b, tuple | list) and len(b) == 2 for b in group):
            return [Call.of(batch[0]) for batch in group]
        self.guessing = False
        return None


class BatchSource:
    """What ``ctx.batches`` reads, as steps: after a resume the batches trained before the
    checkpoint skipped (over as many ``ctx.batches`` as they span; a positioned input, a
    stream, seeks its saved position instead), then ``accumulate`` batches at a time up to
    the job's steps, or a request to stop (:data:`paramserver.inputs.STOP`)."""

    def __init__(
        self,
        accumulate: int,
        resumed_steps: int,
        resumed_position: Any,
        checkpoints: TrainerCheckpoints,
        activity: Activity,
    ):
        self.accumulate = accumulate
        self.to_skip = resumed_steps * accumulate  # batches trained before
        self.resumed_position = resumed_position
        self.checkpoints, self.activity = checkpoints, activity
        self.opened: list[Iterable[Any]] = []  # what ctx.batches read, for its input bytes
        self.positioned: PositionedInput | None = None  # what ctx.batches reads, a stream

    def open(self, iterable: Iterable[Any]) -> Iterator[Any]:
        self.opened.append(iterable)
        positioned = iterable if isinstance(iterable, PositionedInput) else None
        self.positioned = positioned
        if positioned is not None:
            if self.resumed_position is not None:
                positioned.seek(self.resumed_position)
                self.to_skip = 0
            self.checkpoints.stream = positioned
            if hasattr(positioned, "on_idle"):  # waiting for new records is not being stuck
                positioned.on_idle = self.activity.touch
        return iter(iterable)

    def steps(
        self,
        source: Iterator[Any],
        steps_done: int,
        max_steps: int | None,
        restore_rng: Callable[[], None],
    ) -> Iterator[list[Any]]:
        """``source``'s batches in steps, after the ones trained before; the trainer's RNG
        states are restored once those are skipped (the data may draw from them)."""
        if self.to_skip:
            self.to_skip -= sum(1 for _ in itertools.islice(source, self.to_skip))
        if not self.to_skip:
            restore_rng()
        steps = steps_done
        while (max_steps is None or steps < max_steps) and not STOP.is_set():
            group = list(itertools.islice(source, self.accumulate))
            if not group:
                return
            steps += 1
            yield group

    def lag(self) -> tuple[int | None, str]:
        """How far the head of the stream being read is ahead of this trainer, if it says."""
        lag = getattr(self.positioned, "lag", None)
        if lag is None:
            return None, ""
        return lag(), getattr(self.positioned, "lag_unit", "")
