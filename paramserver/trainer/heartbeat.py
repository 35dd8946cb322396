"""A trainer's heartbeats: proof of life for the servers, and a fast alarm when one is lost.

A daemon thread calls every server's ``heartbeat`` each ``interval`` seconds, independent of
data calls, so a server notices a frozen or dead trainer within its ``trainer_timeout``, and the
trainer notices a lost server at once when its connection breaks (a dead process) or within
``timeout_s`` when it stops answering (a frozen one), not at the data call's RPC timeout. A lost
server, or a server that declared this trainer departed, completes :attr:`Heartbeats.alarm`
with the error; :func:`wait_all` gives up waiting on calls as soon as the alarm goes off.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch.futures import Future

from paramserver.errors import ServerLostError, TrainerDepartedError
from paramserver.server.futures import failed
from paramserver.transport.base import Transport

ALARM_POLL_S = 0.05


class Heartbeats:
    def __init__(self, transport: Transport, trainer: int, interval: float, timeout_s: float):
        self.transport = transport
        self.trainer = trainer
        self.interval = interval
        self.timeout_s = timeout_s
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
        self._stopped.set()

    def _run(self) -> None:
        # One heartbeat in flight per server: a server slow to answer one (busy exporting a
        # large shard, say) delays no other server's heartbeats.
        in_flight: dict[int, Future] = {}
        while not self._stopped.is_set():
            for server in range(self.transport.num_servers):
                call = in_flight.get(server)
                if call is not None and not call.done():
                    continue
                if call is not None and not self._answered(server, call):
                    return
                try:
                    in_flight[server] = self.transport.call(
                        server, "heartbeat", self.trainer, timeout_s=self.timeout_s
                    )
                except Exception as error:  # the transport itself is gone
                    in_flight[server] = failed(error)
            self._stopped.wait(self.interval)

    def _answered(self, server: int, call: Future) -> bool:
        """Whether ``server`` answered well; raises the alarm otherwise."""
        try:
            status = call.wait()
        except Exception as error:
            if not self._stopped.is_set():  # else the job is ending: servers go away
                self._raise(
                    ServerLostError(
                        f"server {server} did not answer a heartbeat within "
                        f"{self.timeout_s:g} s (it died, froze or was cut off): "
                        f"{type(error).__name__}: {str(error)[:200]}",
                        server=server,
                    )
                )
            return False
        if status == "departed":
            self._raise(
                TrainerDepartedError(
                    f"server {server} declared trainer {self.trainer} departed "
                    "(it was silent too long); its pushes are refused"
                )
            )
            return False
        return True

    def _raise(self, error: Exception) -> None:
        with self._alarm_lock:
            if not self.alarm.done():
                self.alarm.set_exception(error)


def wait_all(futures: Sequence[Future], alarm: Future | None) -> list[object]:
    """The futures' values once all are done; raises the alarm's error if it goes off first.

    The alarm is polled (every ALARM_POLL_S) rather than given a callback: a callback per
    wait would pile up on the job-long alarm future."""
    if alarm is None:
        return [f.wait() for f in futures]
    done = threading.Event()
    torch.futures.collect_all(list(futures)).add_done_callback(lambda _: done.set())
    while not done.wait(ALARM_POLL_S):
        if alarm.done():
            alarm.wait()  # raises the alarm's error
    return [f.wait() for f in futures]
