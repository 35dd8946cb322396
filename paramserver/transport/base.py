"""The transport interface: the only way a trainer talks to a server.

Two sides, each a small interface. A trainer holds a :class:`Transport` and calls an operation
by name on a server; the server's side is an :class:`Endpoint`, anything that handles
``(op, args)`` and answers with a Future (the server's is
:class:`~paramserver.server.endpoint.ServerEndpoint`). A transport only carries calls between
the two: it never imports the server or the trainer.

Calls return :class:`torch.futures.Future` at once; ``wait()`` on one returns the server's answer
or raises the server's error (a :class:`~paramserver.errors.ParamServerError` subclass keeps its
type). Implementations: :class:`~paramserver.transport.local.LocalTransport` (servers in this
process, for tests and notebooks) and :class:`~paramserver.transport.rpc.RpcTransport`
(torch.distributed.rpc over TensorPipe, the only code that calls torch.distributed.rpc).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

from torch.futures import Future

from paramserver.errors import ServerLostError
from paramserver.transport.operations import PUSH_PULL
from paramserver.wire.messages import PushPullRequest


class Endpoint(Protocol):
    """A server's side of a transport: what calls are delivered to."""

    def handle(self, op: object, args: object) -> Future:
        """Run operation ``op`` with the positional ``args`` (a tuple, as the caller sent it).

        Never raises and never blocks: every outcome, a refused call included, is the returned
        Future's value or error, which the transport carries back to the caller."""
        ...


class Transport(ABC):
    num_servers: int

    @abstractmethod
    def call(self, server: int, op: str, *args: Any, timeout_s: float | None = None) -> Future:
        """Invoke ``op`` (one of the server's registered operations) on ``server``.

        ``timeout_s`` overrides the transport's call timeout for this call (0: none).
        """

    def world(self) -> int:
        """The RPC world this process's calls go to: 0, then the generation of each restart
        of a lost server (see :meth:`restarted_since`)."""
        return 0

    def restarted_since(self, lost: ServerLostError) -> bool:
        """Whether the job restarted the lost server (see
        :func:`paramserver.transport.rpc.watch_restarts`): True once this process is in the
        world after the one ``lost`` failed in, with the restarted server; False where servers
        are never restarted. Waits a bounded time for the restart, then raises
        :class:`ServerLostError` saying it did not come."""
        return False

    def call_all(self, op: str, *args: Any, timeout_s: float | None = None) -> list[Future]:
        """``op`` on every server at once: one future per server, in server order."""
        return [self.call(s, op, *args, timeout_s=timeout_s) for s in range(self.num_servers)]

    def push_pull(self, server: int, request: PushPullRequest) -> Future:
        """Push gradients and pull values in one round trip; the future holds a PushPullReply."""
        return self.call(server, PUSH_PULL.name, request)
