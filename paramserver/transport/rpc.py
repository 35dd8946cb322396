"""RPC transport: the only module that calls ``torch.distributed.rpc`` (TensorPipe).

Worker names: servers are ``server0..server{S-1}`` (ranks ``0..S-1``), trainers are
``trainer0..trainer{T-1}`` (ranks ``S..S+T-1``).

A server process exposes its :class:`~paramserver.server.endpoint.ServerEndpoint`, joins the
RPC world and serves until every worker leaves. The one function exposed to peers is
:func:`_serve`, which hands ``(op, args)`` to the endpoint's registered operations and returns
its Future (``async_execution``), so a waiting sync round never holds an RPC thread.

Local jobs listen on loopback only, from their first moment: they rendezvous through a file (no
TCPStore, which would listen on every interface), and both listeners ``init_rpc`` opens are bound
to ``lo``: TensorPipe's (``TP_SOCKET_IFNAME``) and that of the Gloo group it builds while the ranks
join (``GLOO_SOCKET_IFNAME``; without it Gloo binds to whatever the hostname resolves to, a
network address on most containers and cloud VMs). See :func:`start`.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch.distributed.rpc as rpc
from torch.futures import Future

from paramserver.errors import ParamServerError
from paramserver.server.endpoint import ServerEndpoint
from paramserver.server.futures import chain
from paramserver.transport.base import Transport

_ENDPOINT: ServerEndpoint | None = None


def server_name(index: int) -> str:
    return f"server{index}"


def trainer_name(index: int) -> str:
    return f"trainer{index}"


@rpc.functions.async_execution
def _serve(op: str, args: tuple[Any, ...]) -> Future:
    endpoint = _ENDPOINT
    if endpoint is None:
        failed: Future = Future()
        failed.set_exception(ParamServerError("this process serves no shard"))
        return failed
    return endpoint.handle(op, args)


def start(
    name: str,
    rank: int,
    world_size: int,
    *,
    init_method: str,
    num_threads: int,
    timeout_s: float,
    loopback_only: bool,
) -> None:
    """Join the RPC world. ``init_method`` is ``file://PATH`` for local jobs or ``env://``."""
    # Every static init_rpc warns that gloo is used as a ProcessGroup (pytorch#149393).
    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*", category=UserWarning)
    if loopback_only:
        os.environ["TP_SOCKET_IFNAME"] = "lo"
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=num_threads,
        rpc_timeout=timeout_s,
        init_method=init_method,
        _transports=["uv"],
        _channels=["basic"],
    )
    # torchrun keeps its store across restarts of the ranks, and init_rpc names its keys by a
    # per-process counter (rpc_prefix_0 in every fresh process): a restarted rank would meet the
    # previous attempt's keys and fail to connect. Start the counter at the restart number.
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restarts:
        with rpc._init_counter_lock:  # private to torch: see the comment above
            rpc._init_counter = max(rpc._init_counter, restarts)
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)


def expose(endpoint: ServerEndpoint | None) -> None:
    """Serve ``endpoint`` to peers. Call before :func:`start`: peers may call as soon as the
    RPC world is up."""
    global _ENDPOINT
    _ENDPOINT = endpoint


def stop(graceful: bool = True) -> None:
    """Leave the RPC world; graceful waits for every other worker to leave too."""
    rpc.shutdown(graceful=graceful)


class RpcTransport(Transport):
    """Calls servers over RPC; ``timeout_s`` bounds each call (0 means no timeout)."""

    def __init__(self, num_servers: int, timeout_s: float):
        self.num_servers = num_servers
        self.timeout_s = timeout_s
        self._names = [server_name(i) for i in range(num_servers)]

    def call(self, server: int, op: str, *args: Any, timeout_s: float | None = None) -> Future:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        answer = rpc.rpc_async(self._names[server], _serve, args=(op, args), timeout=timeout)
        return chain(answer, _raise_remote_error)


def _raise_remote_error(value: Any) -> Any:
    # An async_execution future completed with an exception arrives as the exception object
    # itself (pickled whole, type and message intact): raise it here, as the server meant.
    if isinstance(value, BaseException):
        raise value
    return value
