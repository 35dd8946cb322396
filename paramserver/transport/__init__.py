"""How trainers reach servers: one narrow interface, an in-process and an RPC implementation."""

from paramserver.transport.base import Endpoint, Transport
from paramserver.transport.local import LocalTransport

__all__ = ["Endpoint", "LocalTransport", "Transport"]
