"""RPC transport: the only module that calls ``torch.distributed.rpc`` (TensorPipe).

Worker names: servers are ``server0..server{S-1}`` (ranks ``0..S-1``), trainers are
``trainer0..trainer{T-1}`` (ranks ``S..S+T-1``).

A server process exposes its :class:`~paramserver.transport.base.Endpoint` (the server's
:class:`~paramserver.server.endpoint.ServerEndpoint`), joins the RPC world and serves until every
worker leaves. The one function exposed to peers is :func:`_serve`, which hands ``(op, args)``
to the endpoint and returns its Future (``async_execution``), so a waiting sync round never
holds an RPC thread.

Failures reach trainers as the project's typed errors. A server's own errors travel inside its
answer (pickled whole) and are raised as they are. A call that fails in transit, because the
server died (TensorPipe's ``EOF``, ``ECONNRESET``, ``EPIPE``...) or did not answer in time (the
RPC timeout), raises :class:`~paramserver.errors.ServerLostError` naming the server, not
TensorPipe's bare ``RuntimeError``; see :meth:`RpcTransport.call`.

Local jobs listen on loopback only, from their first moment: they rendezvous through a file (no
TCPStore, which would listen on every interface), and both listeners ``init_rpc`` opens are bound
to ``lo``: TensorPipe's (``TP_SOCKET_IFNAME``) and that of the Gloo group it builds while the ranks
join (``GLOO_SOCKET_IFNAME``; without it Gloo binds to whatever the hostname resolves to, a
network address on most containers and cloud VMs). See :func:`start`.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

import torch.distributed.rpc as rpc
from torch.futures import Future

from paramserver.errors import ParamServerError, ServerLostError
from paramserver.transport.base import Endpoint, Transport

_ENDPOINT: Endpoint | None = None


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
    generation: int = 0,
) -> None:
    """Join the RPC world of ``generation`` (0: the job's first; see
    :func:`leave_lost_world`). ``init_method`` is ``file://PATH`` for local jobs (each
    generation its own file) or ``env://``."""
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
    # init_rpc names its keys in the rendezvous store by a per-process counter of the worlds
    # it joined (rpc_prefix_N, pytorch#42723), so members that joined different numbers of
    # worlds never meet: a rank torchrun restarted (its store is kept across restarts) in a
    # fresh process, or a server started anew beside survivors that rejoin. Every member of
    # one world sets the counter to that world's number: torchrun's restart count, or the
    # generation of a rejoin.
    generation = max(generation, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    with rpc._init_counter_lock:  # private to torch: see the comment above
        rpc._init_counter = generation
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)


def leave_lost_world() -> None:
    """Leave the RPC world at once (a member was lost: no goodbye is possible), to join the
    next generation's with :func:`start` beside a process started anew in the lost one's
    place. Torch cannot re-admit a rank to a world after a member died (its join times out),
    but a process can join a new one, keeping everything it holds; calls under way in the
    old world fail (ServerLostError)."""
    rpc.shutdown(graceful=False)
    # The gathers of a graceful shutdown are numbered per set of worker names, counted from
    # the process's first world: a fresh member of the new world starts at 0, so every
    # survivor does too (private to torch, as the counter in start()).
    rpc.api._all_gather_sequence_id.clear()
    rpc.api._all_gather_sequence_id_to_states.clear()


def expose(endpoint: Endpoint | None) -> None:
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
        """The server's answer, its own error as it raised it, or :class:`ServerLostError`
        naming it when the call failed in transit (the server died, or did not answer within
        the timeout)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        sent = rpc.rpc_async(self._names[server], _serve, args=(op, args), timeout=timeout)
        answer: Future = Future()

        def settle(done: Future) -> None:
            try:
                value = done.value()
            except Exception as error:
                answer.set_exception(_transit_error(error, server, op, timeout))
                return
            # An async_execution future completed with an exception arrives as the exception
            # object itself (pickled whole, type and message intact): raise it, as the server
            # meant.
            if isinstance(value, BaseException):
                answer.set_exception(value)
            else:
                answer.set_result(value)

        sent.add_done_callback(settle)
        return answer


# TensorPipe's messages: "RPCErr:1:RPC ran for more than set timeout (500 ms) ...", "EOF: end of
# file (this error originated at tensorpipe/transport/uv/connection_impl.cc:132)".
_RPC_ERROR_CODE = re.compile(r"^RPCErr:\d+:")
_ORIGIN = re.compile(r"\s*\(this error originated at [^)]*\)")


def _transit_error(error: Exception, server: int, op: str, timeout_s: float) -> Exception:
    """The error a caller sees for a call that failed before the server could answer it.

    Only TensorPipe's own failures (a ``RuntimeError``) mean the server is lost. An error
    the RPC layer re-raised from the server's side (its message starts ``On WorkerInfo(``: the
    server could not unpickle the call, say) and any other error is kept as it is.
    """
    message = str(error)
    remote = isinstance(error, ParamServerError) or message.startswith("On WorkerInfo(")
    if not isinstance(error, RuntimeError) or remote:
        return error
    first_line = message.splitlines()[0] if message else ""
    cause = _ORIGIN.sub("", _RPC_ERROR_CODE.sub("", first_line)).strip() or "no message"
    if "timeout" in cause or "timed out" in cause:
        what = f"did not answer {op} within {timeout_s:g} s (it froze, was cut off or is stuck)"
    else:
        what = f"was lost: {op} failed with {cause} (its process died or its connection broke)"
    lost = ServerLostError(f"server {server} {what}", server=server)
    lost.__cause__ = error
    return lost
