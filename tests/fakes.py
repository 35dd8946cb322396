"""Test doubles: a transport that injects faults at exact calls instead of sleeping and hoping.

``FaultyTransport`` wraps any transport. Rules match a call by ``(server, op, args)``:
- ``delay(seconds, when)``: the call reaches the server that much later (the caller does not
  block: the call is made from a timer thread);
- ``hold(when)``: the server gets the call and does its work, but its answer never arrives;
- ``freeze_after(server, when)``: once a matching call is answered, ``server`` answers nothing
  more, pending answers included (a frozen or cut-off process);
- ``fail(when, error)``: the call fails at once and never reaches its server (a connection
  refused or broken for that one call);
- ``crash_at(server, when)``: at a matching call ``server`` dies: that call and every later one
  to it fail with :class:`ServerLostError`, and so do its answers still pending, as calls to a
  SIGKILLed process fail (the matching call reaches it only if it is a call to another server).
A call that never answers ignores ``timeout_s``, as a transport with no timeout would: what
notices is the caller's own limit (heartbeats, alarms). ``calls`` records every call made, in
order, as ``(server, op)``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from torch.futures import Future

from paramserver.errors import ServerLostError
from paramserver.transport.base import Transport

Match = Callable[[int, str, tuple[Any, ...]], bool]
MakeError = Callable[[int, str], BaseException]


def connection_lost(server: int, op: str) -> ServerLostError:
    """The error a real transport raises for a call whose connection broke."""
    return ServerLostError(f"server {server} was lost: {op} failed (injected fault)", server=server)


class FaultyTransport(Transport):
    def __init__(self, inner: Transport):
        self.inner = inner
        self.num_servers = inner.num_servers
        self.frozen: set[int] = set()
        self.crashed: set[int] = set()
        self.calls: list[tuple[int, str]] = []
        self._delays: list[tuple[float, Match]] = []
        self._holds: list[Match] = []
        self._freezes: list[tuple[int, Match]] = []
        self._fails: list[tuple[MakeError, Match]] = []
        self._crashes: list[tuple[int, Match]] = []
        self._pending: dict[int, list[Future]] = {}  # answers not yet given, by server
        self._lock = threading.Lock()

    def delay(self, seconds: float, when: Match) -> None:
        self._delays.append((seconds, when))

    def hold(self, when: Match) -> None:
        self._holds.append(when)

    def freeze_after(self, server: int, when: Match) -> None:
        self._freezes.append((server, when))

    def fail(self, when: Match, error: MakeError = connection_lost) -> None:
        self._fails.append((error, when))

    def crash_at(self, server: int, when: Match) -> None:
        self._crashes.append((server, when))

    def call(self, server: int, op: str, *args: Any, timeout_s: float | None = None) -> Future:
        result: Future = Future()
        crashes = {s for s, when in self._crashes if when(server, op, args)}
        with self._lock:
            self.calls.append((server, op))
            if server in self.frozen:
                return result  # never answered
            orphans = self._crash(crashes)
            dead = server in self.crashed
            if not dead:
                self._pending.setdefault(server, []).append(result)
        for orphan, lost_server in orphans:  # outside the lock: their callbacks run here
            orphan.set_exception(connection_lost(lost_server, "a call"))
        if dead:
            result.set_exception(connection_lost(server, op))
            return result
        for make_error, when in self._fails:
            if when(server, op, args):
                self._settle(server, result, error=make_error(server, op))
                return result
        held = any(when(server, op, args) for when in self._holds)
        freezes = [s for s, when in self._freezes if when(server, op, args)]

        def forward(answer: Future) -> None:
            with self._lock:
                if server in self.frozen or held:
                    return
                self.frozen.update(freezes)
            try:
                value = answer.value()
            except BaseException as error:
                self._settle(server, result, error=error)
            else:
                self._settle(server, result, value=value)

        def send() -> None:
            self.inner.call(server, op, *args, timeout_s=timeout_s).add_done_callback(forward)

        seconds = sum(s for s, when in self._delays if when(server, op, args))
        if seconds > 0:
            timer = threading.Timer(seconds, send)
            timer.daemon = True
            timer.start()
        else:
            send()
        return result

    def _crash(self, servers: set[int]) -> list[tuple[Future, int]]:
        """Mark ``servers`` dead (under the lock); their pending answers, to be failed."""
        orphans = []
        for server in servers - self.crashed:
            self.crashed.add(server)
            orphans += [(future, server) for future in self._pending.pop(server, [])]
        return orphans

    def _settle(
        self,
        server: int,
        result: Future,
        value: object = None,
        error: BaseException | None = None,
    ) -> None:
        """Give ``result`` its answer unless a crash of ``server`` already failed it."""
        with self._lock:
            pending = self._pending.get(server, [])
            if not any(future is result for future in pending):
                return
            pending[:] = [future for future in pending if future is not result]
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(value)
