"""A trainer's side of checkpoints: the schedule, its own part, and (the chief) the commit.

Every ``--checkpoint-every`` steps (or seconds) the chief, holding the answer to its call ``c``
and the batches of a next step, announces step ``k = c + 1`` to every server; servers pass the
news on in every answer. (Without a next step its next call is its last, whose answer it never
trains on: a checkpoint announced then would never be taken, and an announced checkpoint keeps
sync rounds from closing short.) In sync
mode round ``k`` cannot close before the chief pushes, so every trainer learns of ``k`` with the
answer that completes it, and every shard and every trainer is saved at the same step
boundary. Each trainer saves its data position and RNG states at the first step ``>= k`` (in
async mode trainers are at different steps; each resumes from its own). A trainer reading a
stream (:class:`~paramserver.inputs.PositionedInput`) saves the stream's position with them,
and tells the stream once a checkpoint holding it is committed (it finds out when it saves its
next part, and at the end of the job), so a broker redelivers nothing the model holds.

The chief asks every server for its snapshot before it pushes step ``k``'s gradients, then
continues training while a background thread waits for the servers' and trainers' parts and
commits (see :mod:`paramserver.checkpoint`). A checkpoint that cannot be completed is logged and
skipped; the previous one stays valid. Every wait for a commit watches the heartbeat alarm, so
a server lost while a checkpoint is written ends the job with its error instead of a hang.

A job with a checkpoint directory also saves its final model: once every trainer has left, the
chief has every server snapshot at the job's last step and commits that with each trainer's end
(where its loop ended, staged before it left: see :mod:`paramserver.checkpoint.resume`), marked
``final``: a resume from it with a larger budget trains on. With ``--checkpoint-dir`` alone,
that is the only checkpoint. A stream job's final checkpoint holds each trainer's stream up to
where it ended: once it is committed (never before: a process that dies in between leaves them
pending, for the resume), the chief's stream acknowledges every trainer's entries up to there,
waiting ``STREAM_ACK_S`` at most; a failure is logged, and the job ends as it would (the resume
acknowledges them as it starts).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor
from torch.futures import Future

from paramserver.checkpoint import (
    DENSE_PART,
    Part,
    Saved,
    checkpoint_dir,
    commit,
    write_part,
)
from paramserver.checkpoint.store import committed_steps
from paramserver.config import CheckpointSection
from paramserver.errors import ServerLostError, StreamError
from paramserver.futures import wait_all
from paramserver.inputs import PositionedInput
from paramserver.transport.base import Transport
from paramserver.transport.stub import ServerStub

log = logging.getLogger(__name__)

STREAM_ACK_S = 5.0  # the most a stopping job waits to acknowledge its final checkpoint's entries

RngState = tuple[dict[str, Tensor], dict[str, Any]]


def rng_state() -> RngState:
    """This process's torch, numpy and random states, as tensors and JSON."""
    kind, keys, position, has_gauss, gauss = np.random.get_state(legacy=True)
    version, internal, python_gauss = random.getstate()
    numpy_keys = torch.from_numpy(np.array(keys, dtype=np.int64))
    tensors = {"torch_rng": torch.get_rng_state(), "numpy_keys": numpy_keys}
    meta = {
        "numpy": [kind, int(position), int(has_gauss), float(gauss)],
        "random": [version, list(internal), python_gauss],
    }
    return tensors, meta


def set_rng_state(tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_rng"])
    kind, position, has_gauss, gauss = meta["numpy"]
    keys = tensors["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state((kind, keys, position, has_gauss, gauss))
    version, internal, python_gauss = meta["random"]
    random.setstate((version, tuple(internal), python_gauss))


class TrainerCheckpoints:
    def __init__(
        self,
        settings: CheckpointSection,
        job: Mapping[str, Any],
        trainer: int,
        transport: Transport,
        alarm: Future,
    ):
        """``job``: what a checkpoint records of the job that saved it."""
        self.settings = settings
        self.job = job
        self.trainer = trainer
        self.transport = transport
        self.servers = ServerStub(transport)
        self.alarm = alarm
        self.saved_through = -1  # the newest step this trainer saved its part for
        self.planned = -1  # chief: the newest step it announced
        self.last_planned_at = time.monotonic()
        self.last_planned_step = 0
        self._commits: list[Future] = []  # completed when each commit ends, well or not
        # Chief, --dense-sync allreduce: the dense part's tensors and metadata, saved with its
        # own part (so at the same step boundary) and committed with the servers' parts.
        self.dense_part: Callable[[], Saved] | None = None
        self._dense_written: Part | None = None
        # What ctx.batches reads, where it is a stream: told the position of each committed
        # checkpoint (see the module doc).
        self.stream: PositionedInput | None = None
        self._positions: dict[int, Any] = {}  # by step: positions saved, not yet acknowledged

    def resumed_at(self, step: int) -> None:
        """The job continues from checkpoint ``step``: it is saved already."""
        self.saved_through = self.planned = self.last_planned_step = step

    @property
    def enabled(self) -> bool:
        return self.settings.writes_checkpoints

    def after_reply(
        self,
        call: int,
        announced: int,
        steps_done: int,
        samples: int,
        rng: RngState | None,
        position: Any = None,
    ) -> None:
        """Called with the answer to call ``call`` in hand, before this step computes;
        ``rng``: the RNG states from before the next step's batches were drawn (what a resume
        restores before drawing them again), or None where none are drawn yet (the current
        states are those); ``position``: a stream's, after the steps done."""
        if not self.settings.writes_checkpoints:
            return
        if announced > self.saved_through and call >= announced:
            self.acknowledge_committed()
            self._save_own_part(announced, steps_done, samples, rng, position)
            if self.trainer == 0:
                self._take_and_commit(announced)

    def finish(self) -> None:
        """Wait for the commits under way (the chief, at the end of the job); a lost server
        ends the wait with its error."""
        wait_all(self._commits, self.alarm)
        self.acknowledge_committed()

    def acknowledge_committed(self) -> None:
        """Tell the stream the position of the newest committed checkpoint this trainer saved
        a part of (the ones before it are covered too)."""
        root = self.settings.checkpoint_dir
        if self.stream is None or root is None or not self._positions:
            return
        committed = set(committed_steps(root))
        covered = [step for step in self._positions if step in committed]
        if not covered:
            return
        newest = max(covered)
        self.stream.acknowledge(self._positions[newest])
        self._positions = {s: p for s, p in self._positions.items() if s > newest}

    def save_final(
        self,
        step: int,
        trained: bool,
        stream_ends: dict[str, Any] | None = None,
        trainer_parts: Callable[[int], list[Part]] | None = None,
    ) -> None:
        """Chief, once every trainer has left: the job's final checkpoint ``step`` (see the
        module doc), unless a checkpoint of that step or later is committed already and this
        run ``trained`` nothing (a job resumed from its final checkpoint); one that did is
        saved after it. ``stream_ends``: by trainer, where each one reading a stream ended; a
        resume goes on from there. ``trainer_parts(step)``: the trainers' ends, written into
        checkpoint ``step`` as their parts and committed with it."""
        root = self.settings.checkpoint_dir
        if root is None:
            return
        newest = committed_steps(root)
        if newest and newest[-1] >= step:
            if not trained:
                log.info("the final model is checkpoint %d already", newest[-1])
                return
            step = newest[-1] + 1  # a stream's trainers went on from a final checkpoint
        wait_all(self.servers.take_checkpoint(step), self.alarm)
        parts = cast(list[Part], wait_all(self.servers.checkpoint_part(step), self.alarm))
        if trainer_parts is not None:
            parts.extend(trainer_parts(step))
        if self.dense_part is not None:
            parts.append(write_part(checkpoint_dir(root, step), DENSE_PART, *self.dense_part()))
        meta = {**self.job, "final": True}
        if stream_ends:
            meta["stream_ends"] = stream_ends
        commit(root, step, parts, meta, keep=self.settings.checkpoint_keep)
        log.info("final checkpoint %d committed in %s", step, checkpoint_dir(root, step))
        if stream_ends:
            self._acknowledge_final(step, stream_ends)

    def _acknowledge_final(self, step: int, stream_ends: dict[str, Any]) -> None:
        """Chief, once final checkpoint ``step`` is committed: acknowledge every trainer's
        stream entries it holds (a stream that can: the chief's reader acknowledges for all
        its consumers). Bounded; a failure is logged, not raised: a resume acknowledges them."""
        acknowledge = getattr(self.stream, "acknowledge_every_trainer", None)
        if acknowledge is None:
            return
        positions = {int(t): end["input_position"] for t, end in stream_ends.items()}
        try:
            count = acknowledge(positions, STREAM_ACK_S)
        except StreamError as error:
            log.warning(
                "final checkpoint %d is committed, but the stream entries it holds are not "
                "acknowledged (%s): they stay pending until a job resumed from it starts",
                step,
                error,
            )
            return
        log.info("final checkpoint %d: %d stream entries acknowledged", step, count)

    def announce_if_due(self, call: int) -> None:
        """Chief: announce step ``call + 1`` if a checkpoint is due. Call it only with the
        batches of that next step in hand (see the module docstring)."""
        settings = self.settings
        if not settings.writes_checkpoints or self.trainer != 0:
            return
        due = (
            settings.checkpoint_every is not None
            and call + 1 - self.last_planned_step >= settings.checkpoint_every
        ) or (
            settings.checkpoint_every_s is not None
            and time.monotonic() - self.last_planned_at >= settings.checkpoint_every_s
        )
        # One checkpoint at a time: a trainer saves only the newest announced step, so a new
        # one waits until the last is committed (or given up).
        if not due or self.planned > self.saved_through or self._committing():
            return
        step = call + 1
        try:
            wait_all(self.servers.plan_checkpoint(step), self.alarm)
        except ServerLostError as lost:
            self._give_up(step, lost)  # planned again at the next step
            return
        self.planned, self.last_planned_step, self.last_planned_at = step, step, time.monotonic()

    def _save_own_part(
        self, step: int, steps_done: int, samples: int, rng: RngState | None, position: Any
    ) -> None:
        root = self.settings.checkpoint_dir
        assert root is not None
        tensors, meta = rng if rng is not None else rng_state()
        meta = {**meta, "step": step, "steps_done": steps_done, "samples": samples}
        if position is not None:
            meta["input_position"] = self._positions[step] = position
        part = write_part(checkpoint_dir(root, step), f"trainer-{self.trainer}", tensors, meta)
        if self.dense_part is not None:
            self._dense_written = write_part(
                checkpoint_dir(root, step), DENSE_PART, *self.dense_part()
            )
        try:
            wait_all([self.servers.add_trainer_part(step, self.trainer, part)], self.alarm)
        except ServerLostError as lost:
            self._give_up(step, lost)
        self.saved_through = step

    def _take_and_commit(self, step: int) -> None:
        """Chief: every server snapshots now; a thread commits once every part is written."""
        root = self.settings.checkpoint_dir
        assert root is not None
        try:
            wait_all(self.servers.take_checkpoint(step), self.alarm)
        except ServerLostError as lost:
            self._give_up(step, lost)
            return
        servers = self.servers.checkpoint_part(step, timeout_s=0)
        trainers = self.servers.trainer_parts(step, timeout_s=0)
        dense = [self._dense_written] if self._dense_written is not None else []
        settings = self.settings
        committed: Future = Future()

        def finish() -> None:
            try:
                answers = wait_all([*servers, trainers], self.alarm)
                trainer_parts = cast(list[Part], answers.pop())
                parts = [*cast(list[Part], answers), *trainer_parts, *dense]
                commit(root, step, parts, dict(self.job), keep=settings.checkpoint_keep)
                log.info("checkpoint %d committed in %s", step, checkpoint_dir(root, step))
            except ServerLostError as lost:  # the job stops on its own report; no traceback
                log.warning("checkpoint %d not committed (%s); the previous one stays", step, lost)
            except Exception:
                log.exception("checkpoint %d not committed; the previous one stays", step)
            finally:
                committed.set_result(None)

        self._commits = [c for c in self._commits if not c.done()] + [committed]
        threading.Thread(target=finish, name=f"commit-{step}", daemon=True).start()

    def _give_up(self, step: int, lost: ServerLostError) -> None:
        """Give up checkpoint ``step`` where a server was restarted while it was made (its
        shard restored from its log knows nothing of it): the previous checkpoint stays and
        the next comes as planned. Raises ``lost`` where no server was restarted."""
        if not self.transport.restarted_since(lost):
            raise lost
        log.warning("checkpoint %d given up (a server was restarted meanwhile): %s", step, lost)

    def _committing(self) -> bool:
        return any(not c.done() for c in self._commits)
