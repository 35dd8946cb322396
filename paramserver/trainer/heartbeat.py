"""A trainer's heartbeats: proof of life for the servers, and a fast alarm when one is lost.

A daemon thread calls every server's ``heartbeat`` each ``interval`` seconds, independent of
data calls, so a server notices a frozen or dead trainer within its ``trainer_timeout``, and the
trainer notices a lost server at once when its connection breaks (a dead process) or within
``timeout_s`` when it stops answering (a frozen one), not at the data call's RPC timeout. A lost
server, or a server that declared this trainer departed, completes :attr:`Heartbeats.alarm`
with the error; :func:`~paramserver.futures.wait_all` gives up waiting on calls as soon as the
alarm goes off.

Heartbeats prove the process lives, not that it trains: a trainer blocked in its data (a hung
read, a deadlocked DataLoader) would beat forever. So each heartbeat carries how long the
trainer's loop has made no progress (:class:`Activity`: no batch drawn, no call to a server
made, awaited or answered), and a server departs a trainer idle past the stall limit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from torch.futures import Future

from paramserver.errors import ServerLostError, TrainerDepartedError
from paramserver.futures import ALARM_POLL_S, failed
from paramserver.transport.base import Transport
from paramserver.transport.stub import ServerStub


class Activity:
    """When a trainer's loop last made progress. Thread-safe.

    Idle time counts only once the loop has started (model building is not idle) and not
    while a call to a server is outstanding: a trainer waiting on a server (a sync round
    waiting for a straggler, say) is not the one stuck."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = False
        self._outstanding = 0
        self._last = time.monotonic()

    def start(self) -> None:
        with self._lock:
            self._started = True
            self._last = time.monotonic()

    def touch(self) -> None:
        with self._lock:
            self._last = time.monotonic()

    def call_started(self) -> None:
        with self._lock:
            self._outstanding += 1
            self._last = time.monotonic()

    def call_ended(self) -> None:
        with self._lock:
            self._outstanding -= 1
            self._last = time.monotonic()

    def idle_s(self) -> float:
        """Seconds since the last progress (0 before the loop starts or while waiting)."""
        with self._lock:
            if not self._started or self._outstanding:
                return 0.0
            return time.monotonic() - self._last


class Heartbeats:
    def __init__(
        self,
        transport: Transport,
        trainer: int,
        interval: float,
        timeout_s: float,
        activity: Activity | None = None,
        on_alarm: Callable[[BaseException], None] | None = None,
    ):
        """``activity``: the loop's progress, reported with every heartbeat; ``on_alarm`` is
        called (from the heartbeat thread) with the error when the alarm goes off."""
        self.transport = transport
        self.trainer = trainer
        self.interval = interval
        self.timeout_s = timeout_s
        self.activity = activity or Activity()
        self.on_alarm = on_alarm
        self.alarm: Future = Future()
        self._alarm_lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"trainer{trainer}-heartbeats", daemon=True
        )

    def start(self) -> Heartbeats:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating; returns once the thread has ended (within one heartbeat's wait)."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.interval + ALARM_POLL_S)

    def _run(self) -> None:
        # One heartbeat in flight per server: a server slow to answer one (busy exporting a
        # large shard, say) delays no other server's heartbeats. A heartbeat unanswered past
        # timeout_s is a lost server even where the transport itself never times out.
        in_flight: dict[int, tuple[Future, float]] = {}
        while not self._stopped.is_set():
            now = time.monotonic()
            for server in range(self.transport.num_servers):
                call, sent = in_flight.get(server, (None, now))
                if call is not None and not call.done():
                    if now - sent <= self.timeout_s:
                        continue
                    call = failed(TimeoutError(f"no answer in {now - sent:.1f} s"))
                if call is not None and not self._answered(server, call):
                    return
                try:
                    call = ServerStub(self.transport).heartbeat(
                        server, self.trainer, self.activity.idle_s(), self.timeout_s
                    )
                except Exception as error:  # the transport itself is gone
                    call = failed(error)
                in_flight[server] = (call, now)
            self._stopped.wait(self.interval)

    def _answered(self, server: int, call: Future) -> bool:
        """Whether ``server`` answered well; raises the alarm otherwise."""
        try:
            status = call.wait()
        except Exception as error:
            if self._stopped.is_set():  # the job is ending: servers go away
                return False
            if isinstance(error, ServerLostError):  # the transport said which and why
                try:
                    if self.transport.restarted_since(error):
                        return True  # it is back: beat on, in the new world
                except ServerLostError as not_back:
                    error = not_back
                self._raise(error)
            else:
                self._raise(
                    ServerLostError(
                        f"server {server} did not answer a heartbeat within "
                        f"{self.timeout_s:g} s (it died, froze or was cut off): "
                        f"{type(error).__name__}: {str(error)[:200]}",
                        server=server,
                    )
                )
            return False
        if isinstance(status, str) and status.startswith("departed"):
            reason = status.partition(":")[2].strip() or "it was silent too long"
            self._raise(
                TrainerDepartedError(
                    f"server {server} declared trainer {self.trainer} departed ({reason}); "
                    "its pushes are refused"
                )
            )
            return False
        return True

    def _raise(self, error: Exception) -> None:
        with self._alarm_lock:
            if self.alarm.done():
                return
            self.alarm.set_exception(error)
        if self.on_alarm is not None:
            self.on_alarm(error)
