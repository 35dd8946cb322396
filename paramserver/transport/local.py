"""In-process transport: servers are objects in this process, called directly.

Requests and replies are deep-copied on the way, as a wire would, so a trainer and a server
never share a tensor. Used by the ``threads`` launcher and by most tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.futures import Future

from paramserver.futures import chain
from paramserver.transport.base import Endpoint, Transport
from paramserver.wire.sizing import clone_message


class LocalTransport(Transport):
    def __init__(self, endpoints: Sequence[Endpoint]):
        self.endpoints = endpoints
        self.num_servers = len(endpoints)

    def call(self, server: int, op: str, *args: Any, timeout_s: float | None = None) -> Future:
        answer = self.endpoints[server].handle(op, clone_message(args))
        return chain(answer, clone_message)
