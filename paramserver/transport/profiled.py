"""A transport that profiles every call it passes on: latency and bytes per operation, and
(given an :class:`~paramserver.trainer.heartbeat.Activity`-like tracker) marks each call other
than a heartbeat as the trainer's progress."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from torch.futures import Future

from paramserver.errors import ParamServerError, ServerLostError
from paramserver.observe.calls import CallProfile
from paramserver.transport.base import Transport
from paramserver.wire.sizing import payload_nbytes, payload_size


class CallTracker(Protocol):
    def call_started(self) -> None: ...
    def call_ended(self) -> None: ...


class ProfiledTransport(Transport):
    """Wraps ``inner``; a call's latency runs from the call to its answer (or failure), and
    its bytes are the tensor data of its arguments and answer (:func:`payload_nbytes`), each
    measured once (:meth:`call_sized` takes the caller's measure and hands on the answer's).
    ``activity`` hears of every call but heartbeats as it starts and ends."""

    def __init__(
        self,
        inner: Transport,
        profile: CallProfile | None = None,
        activity: CallTracker | None = None,
    ):
        self.inner = inner
        self.num_servers = inner.num_servers
        self.profile = profile or CallProfile()
        self.activity = activity
        self._label = threading.local()

    @contextmanager
    def profiled_as(self, label: str) -> Iterator[None]:
        """Record this thread's calls under ``LABEL:OP`` meanwhile (evaluation's reads apart
        from training's, say)."""
        self._label.value = label
        try:
            yield
        finally:
            self._label.value = None

    def world(self) -> int:
        return self.inner.world()

    def restarted_since(self, lost: ServerLostError) -> bool:
        return self.inner.restarted_since(lost)

    def call(self, server: int, op: str, *args: Any, timeout_s: float | None = None) -> Future:
        return self._call(server, op, args, payload_nbytes(args), timeout_s, sized=False)

    def call_sized(
        self,
        server: int,
        op: str,
        message: Any,
        nbytes: int,
        *,
        timeout_s: float | None = None,
    ) -> Future:
        """:meth:`call` of ``op(message)`` for a caller that measured ``message`` itself
        (``nbytes``: its :func:`payload_nbytes`) and wants its answer measured too: the
        future's value is ``(answer, payload_size(answer))``. Each message is walked once."""
        return self._call(server, op, (message,), nbytes, timeout_s, sized=True)

    def _call(
        self,
        server: int,
        op: str,
        args: tuple[Any, ...],
        nbytes: int,
        timeout_s: float | None,
        *,
        sized: bool,
    ) -> Future:
        label = getattr(self._label, "value", None)
        name = f"{label}:{op}" if label else op
        self.profile.sent(name, nbytes)
        tracked = self.activity if op != "heartbeat" else None
        if tracked is not None:
            tracked.call_started()
        started = time.perf_counter()
        try:
            answer = self.inner.call(server, op, *args, timeout_s=timeout_s)
        except BaseException:
            if tracked is not None:
                tracked.call_ended()
            raise

        result: Future = Future()

        def record(done: Future) -> None:
            # Recorded before the caller's wait returns: ``result`` completes after.
            seconds = time.perf_counter() - started
            if tracked is not None:
                tracked.call_ended()
            try:
                value = done.value()
            except BaseException as error:  # passed on with its type kept (as ``chain`` does)
                self.profile.answered(name, seconds, 0)
                result.set_exception(error)
                return
            try:
                size = payload_size(value)
            except Exception as error:  # a peer's answer nested past recursion's limit, say
                self.profile.answered(name, seconds, 0)
                result.set_exception(
                    ParamServerError(f"server {server} sent a malformed answer to {op}: {error!r}")
                )
                return
            self.profile.answered(name, seconds, size.nbytes)
            result.set_result((value, size) if sized else value)

        answer.add_done_callback(record)
        return result
