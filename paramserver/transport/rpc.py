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

import json
import logging
import os
import re
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import Tensor
from torch.futures import Future

from paramserver.errors import ConfigError, ParamServerError, ServerLostError
from paramserver.files import write_atomic
from paramserver.futures import failed
from paramserver.transport.base import Endpoint, Transport
from paramserver.transport.operations import DATA_OPERATIONS
from paramserver.transport.sockets import FrameConnection, FrameListener
from paramserver.wire import frames
from paramserver.wire.frames import FrameError

log = logging.getLogger(__name__)

_ENDPOINT: Endpoint | None = None
_LISTENER: FrameListener | None = None  # where the endpoint takes data calls, if it does
_TRANSPORTS: weakref.WeakSet[RpcTransport] = weakref.WeakSet()  # closed by stop()
_DATA_OPS = frozenset(op.name for op in DATA_OPERATIONS)
_JOINED: dict[str, Any] = {}  # the arguments of the last start(), for a rejoin
_WORLD: _Restarts | None = None  # set by watch_restarts()
RESTART_POLL_S = 0.1
STORE_TIMEOUT = timedelta(seconds=30)


def server_name(index: int) -> str:
    return f"server{index}"


def trainer_name(index: int) -> str:
    return f"trainer{index}"


@rpc.functions.async_execution
def _serve(frame: bytearray, large: list[Tensor]) -> Future:
    """A call's frame (``(op, args)``, see :mod:`paramserver.wire.frames`) handed to the
    endpoint; its answer goes back as a frame too (its error as itself)."""
    endpoint = _ENDPOINT
    failed: Future = Future()
    if endpoint is None:
        failed.set_exception(ParamServerError("this process serves no shard"))
        return failed
    try:
        op, args = frames.decode(frame, large)
    except (FrameError, TypeError, ValueError) as error:
        failed.set_exception(error if isinstance(error, FrameError) else FrameError(str(error)))
        return failed
    handled = endpoint.handle(op, args)
    answer: Future = Future()

    def framed(done: Future) -> None:
        # Set on a future of our own, not by then(): an error a callback raises reaches the
        # caller as a RuntimeError, while one set here arrives as itself, its type kept.
        try:
            answer.set_result(frames.encode(done.value()))
        except Exception as error:
            answer.set_exception(error)

    handled.add_done_callback(framed)
    return answer


def _data_address() -> tuple[str, int] | None:
    """Where this process takes data calls over a socket (None: over RPC only)."""
    return None if _LISTENER is None else _LISTENER.address


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
    rendezvous_s: float | None = None,
) -> None:
    """Join the RPC world of ``generation`` (0: the job's first; see
    :func:`leave_lost_world`). ``init_method`` is ``file://PATH`` for local jobs (each
    generation its own file) or ``env://``. The members wait for each other ``rendezvous_s``
    at most (default: ``timeout_s``, the calls' timeout)."""
    # Every static init_rpc warns that gloo is used as a ProcessGroup (pytorch#149393).
    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*", category=UserWarning)
    if loopback_only:
        os.environ["TP_SOCKET_IFNAME"] = "lo"
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=num_threads,
        # init_rpc's rendezvous waits this long, calls made without a timeout too (reset below).
        rpc_timeout=timeout_s if rendezvous_s is None else max(timeout_s, rendezvous_s),
        init_method=init_method,
        _transports=["uv"],
        _channels=["basic"],
    )
    # init_rpc names its keys in the rendezvous store by a per-process counter of the worlds
    # it joined (rpc_prefix_N, pytorch#42723), so members that joined different numbers of
    # worlds never meet: a rank torchrun restarted (its store is kept across restarts) in a
    # fresh process, or a server started anew beside survivors that rejoin. Every member of
    # one world sets the counter to that world's number: the generation of a rejoin, counted
    # anew after each torchrun restart (which starts every member anew).
    counter = generation + 1000 * int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with rpc._init_counter_lock:  # private to torch: see the comment above
        rpc._init_counter = counter
    _JOINED.update(
        name=name, rank=rank, world_size=world_size, num_threads=num_threads,
        timeout_s=timeout_s, loopback_only=loopback_only,
    )  # fmt: skip
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
    if options.rpc_timeout != timeout_s:
        rpc._set_rpc_timeout(timeout_s)
    _JOINED["generation"] = generation  # only once in it: calls made meanwhile were not


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


def expose(
    endpoint: Endpoint | None, *, data_host: str | None = None, max_data_bytes: int = 0
) -> None:
    """Serve ``endpoint`` to peers; with ``data_host``, also take data calls on a socket
    there (:mod:`paramserver.transport.sockets`), closing a connection that sends a message
    over ``max_data_bytes``. Call before :func:`start`: peers may call as soon as the RPC
    world is up. ``expose(None)`` stops serving."""
    global _ENDPOINT, _LISTENER
    if _LISTENER is not None:
        _LISTENER.close()
        _LISTENER = None
    _ENDPOINT = endpoint
    if endpoint is not None and data_host is not None:
        _LISTENER = FrameListener(endpoint, data_host, max_data_bytes)


def stop(graceful: bool = True) -> None:
    """Leave the RPC world; graceful waits for every other worker to leave too. Restarts are
    no longer watched for (:func:`watch_restarts`)."""
    global _WORLD
    if _WORLD is not None:
        _WORLD.close()
        _WORLD = None
    for transport in list(_TRANSPORTS):
        transport.close()
    rpc.shutdown(graceful=graceful)


class RestartBoard(Protocol):
    """Where a lost member's restart is announced, in two steps: the launcher says it started
    one anew (:meth:`restarting`: the members stop counting each other's silence), then the
    new member, its state restored, says it is joining (:meth:`generation`: the members move
    to that world). A member restarted again before it joined never said so, and the others
    wait on in their world for the one that does."""

    def restarting(self) -> int:
        """The newest generation a launcher started a member for (0: none)."""
        ...

    def generation(self) -> int:
        """The newest generation a restarted member joins (0: the job's first world)."""
        ...

    def announce(self, generation: int, *, joining: bool) -> None:
        """Say that a member was started for ``generation`` (the launcher's) or, ``joining``,
        that it joins that world now (the restarted member's)."""
        ...

    def init_method(self, generation: int) -> str:
        """``init_rpc``'s ``init_method`` for the world of ``generation``."""
        ...


class FileBoard:
    """A local job's board: files beside the rendezvous files (``RENDEZVOUS`` for generation
    0, ``RENDEZVOUS.G`` for generation G), each holding a generation."""

    def __init__(self, rendezvous: str | os.PathLike[str]):
        self.rendezvous = Path(rendezvous)

    def _file(self, joining: bool) -> Path:
        kind = "generation" if joining else "restarting"
        return self.rendezvous.with_name(f"{self.rendezvous.name}.{kind}")

    def _read(self, joining: bool) -> int:
        try:
            return int(self._file(joining).read_text())
        except (FileNotFoundError, ValueError):
            return 0

    def restarting(self) -> int:
        return self._read(joining=False)

    def generation(self) -> int:
        return self._read(joining=True)

    def announce(self, generation: int, *, joining: bool) -> None:
        text = str(generation).encode()
        write_atomic(self._file(joining), lambda f: f.write(text), hash_written=False)

    def init_method(self, generation: int) -> str:
        suffix = f".{generation}" if generation else ""
        return f"file://{self.rendezvous}{suffix}"


class StoreBoard:
    """A torchrun job's board: keys in torchrun's agent store (``MASTER_ADDR:MASTER_PORT``,
    which outlives every rank), named per torchrun restart of the whole group; each world's
    ``init_rpc`` meets there too (``env://``, its keys numbered by generation: see
    :func:`start`). Pickled, it keeps its address, not its connection."""

    def __init__(self, host: str, port: int, attempt: int):
        self.host, self.port, self.attempt = host, port, attempt
        self._store: dist.TCPStore | None = None
        self._lock = threading.Lock()

    @classmethod
    def of_torchrun(cls) -> StoreBoard:
        """The board of the torchrun group this process is a rank of."""
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            raise ConfigError(
                "--recover under torchrun needs torchrun's agent store, which outlives a lost "
                "server (TORCHELASTIC_USE_AGENT_STORE=True: torchrun sets it unless "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)"
            )
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return cls(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), attempt)

    def __getstate__(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "attempt": self.attempt}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["host"], state["port"], state["attempt"])  # type: ignore[misc]

    def _key(self, name: str) -> str:
        return f"paramserver/attempt-{self.attempt}/{name}"

    def _connected(self) -> dist.TCPStore:
        with self._lock:
            if self._store is None:
                self._store = dist.TCPStore(
                    self.host, self.port, is_master=False, timeout=STORE_TIMEOUT
                )
            return self._store

    def _read(self, name: str) -> int:
        store, key = self._connected(), self._key(name)
        return int(store.get(key)) if store.check([key]) else 0

    def restarting(self) -> int:
        return self._read("restarting")

    def generation(self) -> int:
        return self._read("generation")

    def announce(self, generation: int, *, joining: bool) -> None:
        name = "generation" if joining else "restarting"
        self._connected().set(self._key(name), str(generation))

    def init_method(self, generation: int) -> str:
        return "env://"

    def finish(self) -> None:
        """The chief's, once the job is done: a server lost now is not restarted."""
        self._connected().set(self._key("finished"), "1")

    def finished(self) -> bool:
        return bool(self._connected().check([self._key("finished")]))

    def record_restart(self, generation: int, record: dict[str, Any]) -> None:
        """What a rank's supervisor tells of the restart for ``generation``, for the summary."""
        self._connected().set(self._key(f"restart-{generation}"), json.dumps(record))

    def restart_records(self) -> list[dict[str, Any]]:
        """The restarts recorded so far, in order."""
        store = self._connected()
        keys = [self._key(f"restart-{g}") for g in range(1, self.restarting() + 1)]
        return [json.loads(store.get(key)) for key in keys if store.check([key])]


def announce_restart(board: RestartBoard) -> int:
    """A launcher's: say that a lost member is started anew; returns the generation of the
    world it is to join."""
    generation = max(board.generation(), board.restarting()) + 1
    board.announce(generation, joining=False)
    return generation


def watch_restarts(
    board: RestartBoard, wait_s: float, on_moving: Callable[[bool], None] | None = None
) -> None:
    """From now on, when ``board`` announces a new generation (a lost member was restarted),
    leave the lost world and join the new one (:func:`leave_lost_world`, :func:`start`),
    keeping everything this process holds; ``on_moving(True)`` before, ``on_moving(False)``
    after. Calls under way fail with :class:`ServerLostError`, whose ``generation`` tells
    :meth:`RpcTransport.restarted_since` to wait (up to ``wait_s``) for the next world."""
    global _WORLD
    assert _WORLD is None and _JOINED, "watch_restarts() follows start(), once"
    _WORLD = _Restarts(board, wait_s, on_moving)


def generation() -> int:
    """The generation of the world this process is in."""
    return int(_JOINED.get("generation", 0))


class _Restarts:
    """The thread that moves this process to each new world its board announces."""

    def __init__(
        self, board: RestartBoard, wait_s: float, on_moving: Callable[[bool], None] | None
    ):
        self.board, self.wait_s = board, wait_s
        self.on_moving = on_moving or (lambda moving: None)
        self.changed = threading.Condition()
        self.moving = False
        self.failure: BaseException | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rpc-restarts", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        paused = False
        while not self._closed.wait(RESTART_POLL_S):
            announced = self.board.generation()
            if not paused and max(announced, self.board.restarting()) > generation():
                paused = True  # a member restarts: silence is no one's fault until it joins
                self.on_moving(True)
            if announced > generation():
                self._rejoin(announced)
                paused = False
                self.on_moving(False)
                if self.failure is not None:
                    return

    def _rejoin(self, announced: int) -> None:
        with self.changed:
            self.moving = True
        log.warning("a member of the job was restarted: joining world %d", announced)
        started = time.monotonic()
        try:
            leave_lost_world()
            joined = {k: v for k, v in _JOINED.items() if k != "generation"}
            start(
                **joined, init_method=self.board.init_method(announced), generation=announced,
                rendezvous_s=self.wait_s,
            )  # fmt: skip
        except BaseException as error:  # every waiter must hear of it
            self.failure = error
        with self.changed:
            self.moving = False
            self.changed.notify_all()
        if self.failure is None:
            log.warning("joined world %d in %.2f s", announced, time.monotonic() - started)

    def wait_past(self, lost: ServerLostError) -> bool:
        """See :meth:`RpcTransport.restarted_since`."""
        if lost.generation is None:
            return False
        deadline = time.monotonic() + self.wait_s
        with self.changed:
            while self.moving or generation() <= lost.generation:
                if self.failure is not None:
                    raise ServerLostError(
                        f"{lost} and joining the world of its restart failed: {self.failure}",
                        server=lost.server,
                    ) from self.failure
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServerLostError(
                        f"{lost}, and was not restarted within {self.wait_s:g} s",
                        server=lost.server,
                    )
                self.changed.wait(min(left, RESTART_POLL_S))
        return True


class RpcTransport(Transport):
    """Calls servers over RPC; ``timeout_s`` bounds each call (0 means no timeout). Data
    calls go over a socket to each server that listens for them
    (:mod:`paramserver.transport.sockets`), connected at the first one; over RPC to the
    others."""

    def __init__(self, num_servers: int, timeout_s: float):
        self.num_servers = num_servers
        self.timeout_s = timeout_s
        self._names = [server_name(i) for i in range(num_servers)]
        # Per server: the RPC world its address was asked in, and the connection (None: it
        # takes data calls over RPC).
        self._connections: dict[int, tuple[int, FrameConnection | None]] = {}
        self._connecting = threading.Lock()
        _TRANSPORTS.add(self)

    def close(self) -> None:
        """Close the data connections (calls under way on them fail as lost)."""
        with self._connecting:
            connections, self._connections = self._connections, {}
        for _, connection in connections.values():
            if connection is not None:
                connection.close()

    def _connection(self, server: int, timeout: float) -> FrameConnection | None:
        """The data connection to ``server``: kept while it works; its address asked again
        in a new RPC world (the server may have been restarted elsewhere), and connected
        anew where it changed or the connection broke. Raises RuntimeError (RPC's) or
        OSError where that fails."""
        world = generation()
        with self._connecting:
            asked_in, connection = self._connections.get(server, (None, None))
            broken = connection is not None and connection.broken is not None
            if asked_in == world and not broken:
                return connection
            address = self._address(server, timeout)
            if connection is None or broken or connection.address != address:
                if connection is not None:
                    connection.close()
                connection = None if address is None else FrameConnection(address, timeout)
            self._connections[server] = (world, connection)
            return connection

    def _address(self, server: int, timeout: float) -> tuple[str, int] | None:
        address = rpc.rpc_sync(self._names[server], _data_address, timeout=timeout)
        return None if address is None else (str(address[0]), int(address[1]))

    def call(self, server: int, op: str, *args: Any, timeout_s: float | None = None) -> Future:
        """The server's answer, its own error as it raised it, or :class:`ServerLostError`
        naming it when the call failed in transit (the server died, or did not answer within
        the timeout)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        sent_in = generation()
        if op in _DATA_OPS:
            try:
                connection = self._connection(server, timeout)
            except RuntimeError as error:
                return failed(_transit_error(error, server, op, timeout, sent_in))
            except OSError as error:  # connecting failed
                timed_out = isinstance(error, TimeoutError)
                return failed(_lost_server(server, op, timeout, sent_in, str(error), timed_out))
            if connection is not None:

                def lost_on_socket(cause: str, timed_out: bool) -> BaseException:
                    return _lost_server(server, op, timeout, sent_in, cause, timed_out)

                return connection.call(op, args, timeout, lost_on_socket)
        try:
            framed = frames.encode((op, args))
            sent = rpc.rpc_async(self._names[server], _serve, args=framed, timeout=timeout)
        except RuntimeError as error:  # between worlds (a restart): no agent to send with
            return failed(_transit_error(error, server, op, timeout, sent_in))
        answer: Future = Future()

        def settle(done: Future) -> None:
            try:
                value = done.value()
            except Exception as error:
                answer.set_exception(_transit_error(error, server, op, timeout, sent_in))
                return
            # An async_execution future completed with an exception arrives as the exception
            # object itself (pickled whole, type and message intact): raise it, as the server
            # meant.
            if isinstance(value, BaseException):
                answer.set_exception(value)
                return
            try:
                answer.set_result(frames.decode(*value))
            except (FrameError, TypeError) as error:  # TypeError: not a frame and tensors
                answer.set_exception(error)

        sent.add_done_callback(settle)
        return answer

    def world(self) -> int:
        return generation()

    def restarted_since(self, lost: ServerLostError) -> bool:
        world = _WORLD
        return world is not None and world.wait_past(lost)


# TensorPipe's messages: "RPCErr:1:RPC ran for more than set timeout (500 ms) ...", "EOF: end of
# file (this error originated at tensorpipe/transport/uv/connection_impl.cc:132)".
_RPC_ERROR_CODE = re.compile(r"^RPCErr:\d+:")
_ORIGIN = re.compile(r"\s*\(this error originated at [^)]*\)")


def _transit_error(
    error: Exception, server: int, op: str, timeout_s: float, sent_in: int
) -> Exception:
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
    timed_out = "timeout" in cause or "timed out" in cause
    lost = _lost_server(server, op, timeout_s, sent_in, cause, timed_out)
    lost.__cause__ = error
    return lost


def _lost_server(
    server: int, op: str, timeout_s: float, sent_in: int, cause: str, timed_out: bool
) -> ServerLostError:
    """What a caller sees for a call to ``server`` sent in world ``sent_in`` that ended with
    no answer, over RPC or a data socket: it timed out, or failed with ``cause``."""
    if timed_out:
        what = f"did not answer {op} within {timeout_s:g} s (it froze, was cut off or is stuck)"
    else:
        what = f"was lost: {op} failed with {cause} (its process died or its connection broke)"
    return ServerLostError(f"server {server} {what}", server=server, generation=sent_in)
