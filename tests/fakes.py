"""Test doubles: a transport that injects faults at exact calls instead of sleeping and hoping.

``FaultyTransport`` wraps any transport. Rules match a call by ``(server, op, args)``:
- ``delay(seconds, when)``: the call reaches the server that much later (the caller does not
  block: the call is made from a timer thread);
- ``hold(when)``: the server gets the call and does its work, but its answer never arrives;
- ``freeze_after(server, when)``: once a matching call is answered, ``server`` answers nothing
  more, pending answers included (a frozen or cut-off process).
A call that never answers ignores ``timeout_s``, as a transport with no timeout would: what
notices is the caller's own limit (heartbeats, alarms).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from torch.futures import Future

from paramserver.transport.base import Transport

Match = Callable[[int, str, tuple[Any, ...]], bool]


class FaultyTransport(Transport):
    def __init__(self, inner: Transport):
        self.inner = inner
        self.num_servers = inner.num_servers
        self.frozen: set[int] = set()
        self._delays: list[tuple[float, Match]] = []
        self._holds: list[Match] = []
        self._freezes: list[tuple[int, Match]] = []
        self._lock = threading.Lock()

    def delay(self, seconds: float, when: Match) -> None:
        self._delays.append((seconds, when))

    def hold(self, when: Match) -> None:
        self._holds.append(when)

    def freeze_after(self, server: int, when: Match) -> None:
        self._freezes.append((server, when))

    def call(self, server: int, op: str, *args: Any, timeout_s: float | None = None) -> Future:
        result: Future = Future()
        with self._lock:
            if server in self.frozen:
                return result  # never answered
        held = any(when(server, op, args) for when in self._holds)
        freezes = [s for s, when in self._freezes if when(server, op, args)]

        def forward(answer: Future) -> None:
            with self._lock:
                if server in self.frozen or held:
                    return
                self.frozen.update(freezes)
            try:
                result.set_result(answer.value())
            except BaseException as error:
                result.set_exception(error)

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
