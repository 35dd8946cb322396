"""A trainer's typed calls of the servers' control operations, through any transport.

Each method is one operation of :mod:`paramserver.transport.operations` (same name), with its
arguments typed and its answer's type said: callers never pass an operation's name. A method
named for all servers returns one future per server, in server order; the others take the
server. ``push_pull`` and ``push_pulls`` travel through the client (measured as they are sent:
:class:`~paramserver.trainer.client.PSClient`), by :data:`~.operations.PUSH_PULL`'s name.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.futures import Future

from paramserver.checkpoint import Part
from paramserver.transport import operations as ops
from paramserver.transport.base import Transport
from paramserver.transport.operations import Operation


class ServerStub:
    """Not thread-safe beyond what its transport is."""

    def __init__(self, transport: Transport):
        self.transport = transport

    def _call(
        self, op: Operation, server: int, *args: Any, timeout_s: float | None = None
    ) -> Future:
        return self.transport.call(server, op.name, *args, timeout_s=timeout_s)

    def _call_all(self, op: Operation, *args: Any, timeout_s: float | None = None) -> list[Future]:
        return self.transport.call_all(op.name, *args, timeout_s=timeout_s)

    def fingerprint(self) -> list[Future[str]]:
        """Each server's shard plan fingerprint."""
        return self._call_all(ops.FINGERPRINT)

    def export_state(self, with_optimizer: bool) -> list[Future[dict[str, dict[str, Tensor]]]]:
        """Copies of each server's values (and optimizer state), by parameter."""
        return self._call_all(ops.EXPORT_STATE, with_optimizer)

    def initial_buffers(self) -> list[Future[dict[str, Tensor]]]:
        """The buffers each server holds, as the chief last set them, or as built."""
        return self._call_all(ops.INITIAL_BUFFERS)

    def load(self) -> list[Future[dict[str, Any]]]:
        """Each server's cumulative counters of work done."""
        return self._call_all(ops.LOAD)

    def stats(self) -> list[Future[dict[str, Any]]]:
        """Each server's statistics, with the trainers' reports server 0 holds."""
        return self._call_all(ops.STATS)

    def dense_check(self, server: int, checksums: dict[str, str]) -> Future[dict[str, Any]]:
        """``server``'s view (a ``ServerView``) of each dense value named in ``checksums``."""
        return self._call(ops.DENSE_CHECK, server, checksums)

    def heartbeat(self, server: int, trainer: int, idle_s: float, timeout_s: float) -> Future:
        """Tell ``server`` that ``trainer`` lives, idle for ``idle_s``."""
        return self._call(ops.HEARTBEAT, server, trainer, idle_s, timeout_s=timeout_s)

    def departed(self) -> list[Future[list[int]]]:
        """The trainers each server declared departed."""
        return self._call_all(ops.DEPARTED)

    def wait_all_left(self) -> list[Future[None]]:
        """Each server's answer once every trainer has left it (no timeout: the alarm bounds
        the wait)."""
        return self._call_all(ops.WAIT_ALL_LEFT, timeout_s=0)

    def finish_job(self, graceful: bool) -> list[Future[None]]:
        """Tell every server the job is done (``graceful``: the RPC world may shut down
        together)."""
        return self._call_all(ops.FINISH_JOB, graceful)

    def plan_checkpoint(self, step: int) -> list[Future[None]]:
        return self._call_all(ops.PLAN_CHECKPOINT, step)

    def take_checkpoint(self, step: int) -> list[Future[None]]:
        return self._call_all(ops.TAKE_CHECKPOINT, step)

    def checkpoint_part(self, step: int, timeout_s: float | None = None) -> list[Future[Part]]:
        """Each server's part of checkpoint ``step`` once written."""
        return self._call_all(ops.CHECKPOINT_PART, step, timeout_s=timeout_s)

    def add_trainer_part(self, step: int, trainer: int, part: Part) -> Future[None]:
        """Tell server 0 (which commits checkpoints) of ``trainer``'s part of ``step``."""
        return self._call(ops.ADD_TRAINER_PART, 0, step, trainer, part)

    def trainer_parts(self, step: int, timeout_s: float | None = None) -> Future[list[Part]]:
        """Server 0's answer once every trainer's part of ``step`` is told."""
        return self._call(ops.TRAINER_PARTS, 0, step, timeout_s=timeout_s)
