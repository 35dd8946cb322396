"""Admitted calls applied to the shard and answered from it, with the books both keep.

Learning rates: an update is applied at the rate its group's schedule gives for the training
step of its gradients (:mod:`paramserver.schedule`): a push's ``grads_step``, or else its
``grads_call``, in async and ssp (its own trainer's step), ``t - 1`` for the round of call
``t`` in sync (every trainer's step ``t - 1``). A schedule that gives no valid factor fails
the push (or the round) with a ConfigError before anything is changed.

Staleness: each answer that trains records how many updates this server had applied; when the
gradients computed from it arrive (``grads_call`` names that call), the updates applied since
are the gradient's staleness (always 0 in sync mode), kept as a histogram
(:class:`~paramserver.server.ages.GradientAges`).

Publishing (``--publish-dir``): in sync mode a round the chief's call marks ``publish`` is cut
into the change log once applied and its answers read, before any is sent, so every server's
segment ends at that round (:mod:`paramserver.changelog.publisher`); other modes cut on a
timer.
"""

from __future__ import annotations

import threading

from paramserver.changelog.publisher import Publisher
from paramserver.server.ages import GradientAges
from paramserver.server.checkpointing import ServerCheckpoints
from paramserver.server.decoded import DecodedRequest
from paramserver.server.liveness import Liveness
from paramserver.server.pooling import PooledPulls
from paramserver.server.rounds import aggregate_mean
from paramserver.server.shard import ServerShard
from paramserver.wire.messages import PushPullReply
from paramserver.wire.sizing import payload_nbytes


class Applier:
    """Applies a call's (or a sync round's) gradients to ``shard`` and reads answers from
    it, keeping the books that go with them: the gradients' ages, the bags a pooled pull
    handed out, the bytes sent, the checkpoint every answer announces. Those books are
    guarded by the coordinator's ``lock``, which its methods take (:meth:`drop_late` is
    called with it held). Thread-safe; it never blocks on another call."""

    def __init__(
        self,
        shard: ServerShard,
        lock: threading.Lock,
        liveness: Liveness,
        ages: GradientAges,
        pooled: PooledPulls,
        checkpoints: ServerCheckpoints,
    ):
        self.shard = shard
        self.stats = shard.stats
        self.lock = lock
        self.liveness = liveness
        self.ages = ages
        self.pooled = pooled
        self.checkpoints = checkpoints
        self.publisher: Publisher | None = None  # set where the job publishes a change log

    def apply(self, request: DecodedRequest, clock: int) -> None:
        """Apply one call's gradients now (async, ssp; a late or initial sync call), at its
        trainer's step, to the rows its ``grads_call`` read; the buffers it carries set."""
        if request.buffers:
            self.shard.store.set_buffers(request.buffers)
        if not request.has_grads:
            return
        with self.lock:
            self.ages.arrived(request.trainer, request.grads_call)
        pull = (request.trainer, request.grads_call)
        # Its trainer's step, the schedule's: named, or that of the call it read.
        step = request.grads_step if request.grads_step >= 0 else max(request.grads_call, 0)
        self.shard.apply(request.dense_grads, request.row_grads, clock, pull, step)
        self._count_update()

    def apply_round(self, call: int, requests: list[DecodedRequest]) -> None:
        """Apply the mean of sync round ``call``'s gradients (``requests`` in trainer order)
        once, each trainer's only to the rows its read handed out; the buffers they carry (the
        chief's) set with it."""
        with self.lock:
            for request in requests:
                if request.has_grads:
                    self.ages.arrived(request.trainer, request.grads_call)
        for request in requests:
            self.shard.drop_grads_of_replaced_rows(request)
        dense, rows = aggregate_mean(requests)
        # Round ``call`` holds the gradients of step ``call - 1`` (read by call - 1).
        self.shard.apply(dense, rows, clock=call, step=call - 1)
        for request in requests:
            if request.buffers:
                self.shard.store.set_buffers(request.buffers)
        self._count_update()

    def round_read(self, call: int, requests: list[DecodedRequest]) -> None:
        """Sync round ``call`` is applied and its answers read (none sent yet): cut it into
        the change log where the chief marked it. After the reads, so the segment holds what
        they changed too (rows admitted and touched), as the trainers' answers do."""
        if self.publisher is not None and any(request.publish for request in requests):
            self.publisher.cut(call, aligned=True)

    def drop_late(self, request: DecodedRequest) -> None:
        """Drop the gradients of a push whose sync round closed without it: they will never be
        applied. Called with the lock held."""
        self.ages.dropped(request.trainer, request.grads_call)
        request.drop_gradients()

    def answer(
        self, request: DecodedRequest, *, train: bool, clock: int = 0, again: bool = False
    ) -> PushPullReply:
        """Read what ``request`` asks for; a ``train`` read (or one ``again``: see
        :meth:`~paramserver.server.coordinator.Coordinator._answer_again`) is recorded for
        the gradients that will come back."""
        if train or again:
            with self.lock:
                if request.trainer in self.liveness.members:  # a leaver's pulls never come back
                    self.ages.read(request.trainer, request.call)
                    self.pooled.pulled(request.trainer, request.call, request.pool_rows)
        reply = self.shard.read(request, train=train, clock=clock, again=again)
        reply.checkpoint_at = self.checkpoints.planned
        publisher = self.publisher
        if publisher is not None and publisher.recovers:
            reply.durable_through = publisher.released_through(request.trainer)
        with self.stats.lock:
            self.stats.bytes_sent += payload_nbytes(reply)
        return reply

    def _count_update(self) -> None:
        with self.lock:
            self.ages.updates += 1
