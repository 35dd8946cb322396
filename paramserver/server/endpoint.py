"""The operations a server exposes to trainers: the whole remote surface of a server.

Transports deliver ``(op, args)`` here and nothing else; an op that is not listed in
:data:`~paramserver.transport.operations.OPERATIONS` is refused, and one whose arguments are not
of the types it lists. Every op returns a :class:`torch.futures.Future` and none blocks.

Size cap (``--max-message-mb``): a call whose arguments hold more, once decoded, is refused
before it runs. ``push_pull`` and ``pull`` are measured by the coordinator, with the rows their
answers read (:meth:`~paramserver.server.requests.RequestChecks.check_size`); the other answers are
the server's own state or small.
"""

from __future__ import annotations

import reprlib
import threading
from typing import Any

from torch import Tensor
from torch.futures import Future

from paramserver.checkpoint import Part
from paramserver.errors import ParamServerError
from paramserver.futures import completed, failed
from paramserver.server.coordinator import Coordinator
from paramserver.transport.operations import OPERATIONS
from paramserver.wire.sizing import message_nbytes


class ServerEndpoint:
    """A server's :class:`~paramserver.transport.base.Endpoint`: checks each call's operation,
    arguments and size, then runs it on the coordinator, the shard or the checkpoints."""

    def __init__(self, coordinator: Coordinator, buffers: dict[str, Tensor] | None = None):
        """``buffers``: the model's buffers as built that the store does not hold (those not
        persistent; trainers build theirs without values)."""
        self.coordinator = coordinator
        self.buffers = buffers or {}
        self.shard = coordinator.shard
        self.checkpoints = coordinator.checkpoints
        # Set by the chief once the job's results are gathered: the server may then go.
        self.finished = threading.Event()
        self.graceful = True

    def handle(self, op: object, args: object) -> Future:
        if type(op) is not str or op not in OPERATIONS:
            return failed(ParamServerError(f"server {self.shard.server}: unknown operation {op!r}"))
        operation = OPERATIONS[op]
        expected = operation.args
        if (
            type(args) is not tuple
            or len(args) != len(expected)
            or not all(isinstance(a, t) for a, t in zip(args, expected, strict=True))
        ):
            return failed(
                ParamServerError(
                    f"server {self.shard.server}: bad arguments to {op}: {reprlib.repr(args)}"
                )
            )
        cap = self.coordinator.max_message_bytes
        if not operation.sized_by_coordinator and (held := message_nbytes(args)) > cap:
            return failed(
                ParamServerError(
                    f"server {self.shard.server}: a {op} call holding {held} bytes exceeds the "
                    f"cap of {cap} bytes (--max-message-mb)"
                )
            )
        try:
            return getattr(self, f"_op_{op}")(*args)
        except Exception as error:  # whatever goes wrong, the caller hears of it; no RPC fault
            return failed(error)

    def _op_push_pull(self, request: Any) -> Future:
        return self.coordinator.push_pull(request)

    def _op_push_pulls(self, requests: list) -> Future:
        return self.coordinator.push_pulls(requests)

    def _op_pull(self, request: Any) -> Future:
        return self.coordinator.pull(request)

    def _op_wait_all_left(self) -> Future:
        return self.coordinator.wait_all_left()

    def _op_export_state(self, with_optimizer: bool) -> Future:
        return completed(self.shard.store.export_state(with_optimizer=bool(with_optimizer)))

    def _op_stats(self) -> Future:
        stats: dict[str, Any] = dict(self.shard.stats.as_dict())
        stats["tables"] = self.shard.store.table_stats()
        stats["recovery"] = self.shard.stats.recovery
        stats.update(self.coordinator.stats())
        return completed(stats)

    def _op_load(self) -> Future:
        """Cumulative counters of the work done, cheap to read while training."""
        load: dict[str, Any] = dict(self.shard.stats.as_dict())
        load.update(self.coordinator.staleness_totals())
        return completed(load)

    def _op_dense_check(self, checksums: dict) -> Future:
        return completed(self.shard.dense_check(checksums))

    def _op_heartbeat(self, trainer: int, idle_s: float) -> Future:
        return self.coordinator.heartbeat(trainer, idle_s)

    def _op_plan_checkpoint(self, step: int) -> Future:
        return self.checkpoints.plan(step)

    def _op_take_checkpoint(self, step: int) -> Future:
        return self.checkpoints.take(step)

    def _op_checkpoint_part(self, step: int) -> Future:
        return self.checkpoints.part(step)

    def _op_add_trainer_part(self, step: int, trainer: int, part: Part) -> Future:
        return self.checkpoints.add_trainer_part(step, trainer, part)

    def _op_trainer_parts(self, step: int) -> Future:
        return self.checkpoints.trainer_parts(step)

    def _op_departed(self) -> Future:
        return completed(self.coordinator.departed())

    def _op_finish_job(self, graceful: bool) -> Future:
        self.graceful = bool(graceful)
        self.finished.set()
        return completed(None)

    def _op_initial_buffers(self) -> Future:
        """The buffers held here (the store's, as the chief last set them) and as built."""
        held = self.shard.store.read_dense(sorted(self.shard.store.buffers)).values
        return completed({**self.buffers, **held})

    def _op_fingerprint(self) -> Future:
        return completed(self.shard.plan.fingerprint)
