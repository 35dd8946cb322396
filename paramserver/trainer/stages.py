"""A step's stages: its call sent, its answer waited for, its values loaded, its gradients sent
with a later call. :class:`StepCalls` holds the calls of the one-call-per-step schedules (on
demand, recorded ahead, prefetch) and what is in flight between them; :class:`GroupedSteps`
computes ``steps_per_call`` steps from one pull. The context (:mod:`paramserver.trainer.context`)
draws the batches, counts the steps and runs the model; these run the calls. A GPU trainer's
copy of the pulled values to the device (pinned staging buffers) belongs in
:meth:`StepCalls.load`, the one place the values reach the replica.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from paramserver.config import TrainConfig
from paramserver.trainer.checkpointing import TrainerCheckpoints, rng_state
from paramserver.trainer.client import InFlight, PSClient, Pulled, StepPush
from paramserver.trainer.dense import AllReducedDense
from paramserver.trainer.heartbeat import Activity
from paramserver.trainer.observer import Observer
from paramserver.trainer.ownupdates import Asked, OwnUpdates
from paramserver.trainer.replica import Replica
from paramserver.trainer.steps import AheadRecorder, Group, Step
from paramserver.types import Progress
from paramserver.wire.reports import TrainerReport


class TheLoop(Protocol):
    """What a stage needs of the context that runs it: its counts (saved with a checkpoint),
    its RNG restored after a resume, and its batches handed to the loop."""

    steps: int
    samples: int
    position: Any
    step_end: Any  # the position after the step computing

    def restore_rng(self) -> None: ...
    def each_batch(self, step: Step) -> Iterator[Any]: ...
    def end_if_short(self, step: Step) -> None: ...


@dataclass
class Engine:
    """The pieces of a trainer the context drives."""

    trainer: int
    config: TrainConfig
    replica: Replica
    client: PSClient
    checkpoints: TrainerCheckpoints
    activity: Activity
    observer: Observer
    on_progress: Callable[[Progress], None] | None
    dense: AllReducedDense | None = None  # --dense-sync allreduce: the trainer's own


@dataclass
class Gradients:
    """A step's gradients, waiting to ride on the next call."""

    dense: dict[str, Tensor] = field(default_factory=dict)
    rows: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    pooled: dict[str, tuple[int, Tensor]] = field(default_factory=dict)
    pull_call: int = -1  # the call whose answer they were computed from
    step: int = -1  # their training step, where it is not pull_call (steps per call > 1)
    # The steps before it computed from the same pull, pushed by calls of their own before it.
    earlier: list[StepPush] = field(default_factory=list)

    @classmethod
    def of(cls, replica: Replica, pull_call: int, step: int = -1) -> Gradients:
        dense, rows = replica.gradients()
        pooled = {name: (pull_call, g) for name, g in replica.pooled_gradients().items()}
        return cls(dense, rows, pooled, pull_call, step)

    def with_earlier(self) -> list[StepPush]:
        """These gradients (if any) after the earlier ones: what a later step pushes first."""
        if self.pull_call < 0:
            return []
        return [*self.earlier, StepPush(self.dense, self.rows, self.pull_call, self.step)]

    def push(
        self,
        client: PSClient,
        following: Step | None,
        state_masks: dict[str, Tensor] | None = None,
        dense_state: bool = False,
        final: bool = False,
        report: TrainerReport | None = None,
    ) -> InFlight:
        """Send these gradients, pulling what ``following`` needs (and the optimizer state of
        the rows ``state_masks`` pick, and with ``dense_state`` of the dense values); they are
        then spent."""
        in_flight = client.push_pull(
            self.dense,
            self.rows,
            following.ids or {} if following else {},
            pool_bags=following.bags if following else {},
            pooled_grads=self.pooled,
            pull_dense=following is not None,
            final=final,
            report=report,
            grads_call=self.pull_call,
            grads_step=self.step,
            pull_state=state_masks,
            pull_dense_state=dense_state,
            earlier=self.earlier,
        )
        self.dense, self.rows, self.pooled, self.pull_call, self.step = {}, {}, {}, -1, -1
        self.earlier = []
        return in_flight


class StepCalls:
    """The calls of a trainer's steps, one per step: what is pending (the last step's
    gradients), in flight (the call under way and the step it pulls for) and answered (the
    current step's values, ``pulled``: None where no step has begun)."""

    def __init__(self, engine: Engine, own_updates: OwnUpdates | None, prefetch: bool):
        self.engine = engine
        self.own_updates = own_updates
        self.prefetch = prefetch
        self.pending = Gradients()  # the last step's, not sent yet
        self.in_flight: InFlight | None = None
        self.in_flight_pulls: Step | None = None  # the step whose values it pulls
        self.in_flight_asked: Asked | None = None  # the state it asks, prefetching
        self.pulled: Pulled | None = None  # the current step's answer (None: not begun)
        self.last_call: int | None = None  # the newest call answered

    def begin(
        self, loop: TheLoop, step: Step, record_next: Callable[[], Step | None] | None
    ) -> tuple[bool, Step | None]:
        """Get ``step``'s values (sending the call unless one is under way); draw and record
        the next step with ``record_next`` (None: the loop's own data, unknown until its first
        forward) and, prefetching, send the last step's gradients at once, with the next
        step's pull where it is recorded; then load the values into the replica. Returns
        whether the next step was drawn, and it."""
        engine = self.engine
        loop.restore_rng()
        if self.in_flight is not None and self.in_flight_pulls is not step:
            self.last_call = self.in_flight.wait().call  # a push that pulled nothing
            self.in_flight = None
        if self.in_flight is None:
            if self.last_call is not None:  # a next step exists: this one
                engine.checkpoints.announce_if_due(self.last_call)
            self.send(step)
        assert self.in_flight is not None
        # The next step is drawn and recorded while the call is under way; a checkpoint saves
        # the RNG states from before it was drawn.
        rng = rng_state() if record_next is not None and engine.checkpoints.enabled else None
        ahead = record_next() if record_next is not None else None
        prefetching = (
            record_next is not None and self.prefetch and (ahead is None or ahead.ids is not None)
        )
        asked = self.ask(ahead, step) if prefetching else None  # found while the call is away
        pulled = self.in_flight.wait()
        self.in_flight = None
        # The pending gradients are not in the answer: applied to it once the next call,
        # which pushes them, is under way (the servers' work then overlaps the trainer's).
        pending = self.pending
        own = (pending.dense, pending.rows, pending.pull_call, self.in_flight_asked)
        # Before a checkpoint's part is saved, and before computing; prefetching (the mode
        # allows a step of staleness), the last step's all-reduce may go on during this one.
        self.apply_dense(keep=1 if self.prefetch else 0)
        self.pulled, self.last_call = pulled, pulled.call
        engine.checkpoints.after_reply(
            pulled.call, pulled.checkpoint_at, loop.steps, loop.samples, rng, loop.position
        )
        loop.step_end = step.end
        if record_next is not None:
            if ahead is not None:
                engine.checkpoints.announce_if_due(pulled.call)
            if prefetching:
                self.send(ahead, asked)
        if self.own_updates is not None:
            self.own_updates.apply(pulled, *own)
        self.load(pulled, step)
        return record_next is not None, ahead

    def load(self, pulled: Pulled, step: Step) -> None:
        """The step's values into the replica."""
        self.engine.replica.load(
            pulled.dense,
            pulled.rows,
            {name: (pulled.pooled[name], bags) for name, bags in step.bags.items()},
            step.lookups,
        )

    def ask(self, following: Step | None, pending_of: Step) -> Asked | None:
        """What a prefetch of ``following`` asks the state of, where own updates apply: the
        rows the update of ``pending_of`` (the step whose gradients will be pending when it is
        answered) touches, and the dense values'."""
        own = self.own_updates
        if own is None or following is None:
            return None
        unknown = {n: ids for n, ids in (following.ids or {}).items() if n not in own.known}
        return own.rows_to_ask(unknown, pending_of.ids or {})

    def send(self, following: Step | None, asked: Asked | None = None) -> None:
        """Start the call that pushes the pending gradients and pulls ``following``'s values,
        with the state ``asked`` (:meth:`ask`: a prefetch's)."""
        own = self.own_updates
        masks = asked.masks if asked is not None else None
        dense_state = asked is not None and own is not None and own.asks_dense_state
        self.in_flight = self.pending.push(self.engine.client, following, masks, dense_state)
        self.in_flight_pulls, self.in_flight_asked = following, asked

    def apply_dense(self, keep: int = 0) -> None:
        if self.engine.dense is not None:
            self.engine.dense.finish(keep)

    def finish(self) -> Gradients:
        """Once the loop has returned: wait for a call still under way; returns the gradients
        the last call must push."""
        if self.in_flight is not None:
            self.in_flight.wait()  # a prefetch whose step never came
            self.in_flight = None
        self.apply_dense()
        return self.pending


class GroupedSteps:
    """``steps_per_call`` steps at a time computed from one pull, while their lookups are
    recorded: each step's own update is applied to the values the group's later steps load,
    and the group's gradients go, each step a call of its own, in one message per server with
    the next group's pull. A step drawn without its lookups ends grouping (``leftover``: it
    and the steps after it take one call each)."""

    def __init__(self, calls: StepCalls, steps_per_call: int):
        self.calls = calls
        self.steps_per_call = steps_per_call
        self.current: Group | None = None  # the steps computing from the current pull
        self.following: Group | None = None  # drawn and recorded while it was pulled
        self.leftover: Step | None = None  # a step drawn without its lookups

    def run(self, loop: TheLoop, recorder: AheadRecorder) -> Iterator[Any]:
        group = self._draw(recorder)
        while group is not None:
            self._begin(loop, group, recorder)
            for at, step in enumerate(group.steps):
                self._load_step(loop, group, at)
                yield from loop.each_batch(step)
                loop.end_if_short(step)
            group, self.following = self.following, None

    def _draw(self, recorder: AheadRecorder) -> Group | None:
        """Up to ``steps_per_call`` recorded steps (None: none left)."""
        steps: list[Step] = []
        while self.leftover is None and len(steps) < self.steps_per_call:
            step = recorder.next()
            if step is None:
                break
            if step.ids is None:
                self.leftover = step
            else:
                steps.append(step)
        return Group.of(steps) if steps else None

    def _begin(self, loop: TheLoop, group: Group, recorder: AheadRecorder) -> None:
        """Get ``group``'s values (sending its call unless it is under way), drawing and
        recording the next group meanwhile."""
        calls, checkpoints = self.calls, self.calls.engine.checkpoints
        loop.restore_rng()
        if calls.in_flight is None:
            self._send(group)
        assert calls.in_flight is not None and calls.in_flight_pulls is group.steps[0]
        rng = rng_state() if checkpoints.enabled else None
        self.following = self._draw(recorder)
        pulled = calls.in_flight.wait()
        calls.in_flight = None
        calls.last_call = pulled.call
        checkpoints.after_reply(
            pulled.call, pulled.checkpoint_at, loop.steps, loop.samples, rng, loop.position
        )
        group.values, self.current = pulled, group

    def _send(self, group: Group) -> None:
        """Push the pending steps, each with a call of its own, and pull ``group``'s rows (with
        the state of those several of its steps touch) in one message per server."""
        calls = self.calls
        own = calls.own_updates if len(group.steps) > 1 else None
        masks = own.to_ask(group.masks) if own is not None else None
        dense_state = own is not None and own.asks_dense_state
        following = Step([], group.ids)
        calls.in_flight = calls.pending.push(calls.engine.client, following, masks, dense_state)
        calls.in_flight_pulls, calls.in_flight_asked = group.steps[0], None

    def _load_step(self, loop: TheLoop, group: Group, at: int) -> None:
        group.at, self.calls.pulled = at, group.step_values(at)
        step = group.steps[at]
        loop.step_end = step.end
        values = self.calls.pulled
        self.calls.engine.replica.load(values.dense, values.rows, {}, step.lookups)

    def gradients_of(self, pulled: Pulled) -> Gradients:
        """The step just ended's gradients, after the group's earlier steps'."""
        group = self.current
        assert group is not None
        earlier = self.calls.pending.with_earlier()
        pending = Gradients.of(self.calls.engine.replica, pulled.call, pulled.call + group.at)
        pending.earlier = earlier
        return pending

    def after_step(self) -> None:
        """Once a step of the group has its gradients pending: apply them to the values the
        group's later steps load, or after its last, send them all with the next group's
        pull."""
        group, calls = self.current, self.calls
        pending, own = calls.pending, calls.own_updates
        assert group is not None and own is not None and group.values is not None
        if group.at < len(group.steps) - 1:
            own.apply(group.values, pending.dense, pending.rows, pending.step, keep_state=True)
            return
        self.current = None
        following = self.following
        if following is not None:
            # The checkpoint step is the message's last call: the one that pulls.
            calls.engine.checkpoints.announce_if_due(
                calls.engine.client.next_call + len(pending.earlier) - 1
            )
            self._send(following)
