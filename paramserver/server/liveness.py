"""Membership and liveness: which trainers a server counts, and whether each is still heard from.

Membership: all trainers start as members, whom sync rounds and SSP bounds count. A trainer
whose data has ended leaves (its push marked ``final``); one silent (no call, no heartbeat) for
``trainer_timeout`` seconds, or whose heartbeats report its loop idle (no batch drawn, no call
made or awaited) for the stall limit, is declared departed: rounds and bounds stop counting it,
and its later calls are refused. Silence is counted from a trainer's last call or heartbeat,
or, before its first, from the first contact of any trainer (all start together, after the RPC
barrier).

A watchdog thread (:class:`Watchdog`) ticks the coordinator's liveness check, which declares
silent trainers departed, closes rounds past their deadline and releases held answers; it only
completes Futures.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable

from torch.futures import Future

from paramserver.config import ConsistencySettings
from paramserver.errors import ParamServerError, TrainerDepartedError
from paramserver.futures import completed, failed

WATCHDOG_PERIOD_S = 0.1

log = logging.getLogger(__name__)


class Liveness:
    """Server ``server``'s view of the trainers: members, those that left, those declared
    departed (and why), and when each was last heard from.

    Its state is guarded by the coordinator's ``lock``: the methods that say so are called
    with it held, the others take it. ``depart(trainer, reason)`` is the coordinator's: it
    takes a trainer out of rounds and bounds, and calls :meth:`remove`."""

    def __init__(
        self,
        server: int,
        settings: ConsistencySettings,
        lock: threading.Lock,
        depart: Callable[[int, str], None],
    ):
        self.server = server
        self.num_trainers = settings.num_trainers
        self.trainer_timeout = settings.trainer_timeout
        self.stall_limit = settings.stall_limit
        self.lock = lock
        self._depart = depart
        self.members: set[int] = set(range(settings.num_trainers))
        self.left: set[int] = set()
        self.departed: dict[int, str] = {}  # trainer -> why it was declared departed
        self.silence_s: dict[int, float] = {}  # departed trainer -> its silence or idle time
        self.last_seen: dict[int, float] = {}
        self.paused = False  # while the RPC world changes (a server restarted): no one is heard
        self._first_contact: float | None = None
        self._all_left: list[Future] = []

    # ---- called with the lock held ----

    def seen(self, trainer: int) -> None:
        """``trainer`` was heard from now. Called with the lock held."""
        now = time.monotonic()
        self.last_seen[trainer] = now
        if self._first_contact is None:
            self._first_contact = now

    def departure(self, trainer: int) -> TrainerDepartedError | None:
        """The refusal of a call from ``trainer`` if it was declared departed. Called with
        the lock held."""
        reason = self.departed.get(trainer)
        if reason is None:
            return None
        return TrainerDepartedError(
            f"server {self.server}: trainer {trainer} was declared departed ({reason}); its "
            "later calls are refused"
        )

    def refusal(self, trainer: int) -> TrainerDepartedError | None:
        """The refusal of a new call from ``trainer`` if it is no member (departed, or left).
        Called with the lock held."""
        if trainer in self.departed:
            return self.departure(trainer)
        if trainer not in self.members:
            return TrainerDepartedError(f"server {self.server}: trainer {trainer} already left")
        return None

    def remove(self, trainers: Iterable[int], *, departed: bool, reason: str) -> list[Future]:
        """Take the members among ``trainers`` out: they left, or (``departed``) were declared
        departed for ``reason``. Returns the waits of :meth:`wait_all_left` this completes,
        for the caller to complete once it has let the lock go. Called with the lock held."""
        for trainer in trainers:
            if trainer not in self.members:
                continue
            self.members.discard(trainer)
            if departed:
                self.departed[trainer] = reason
            else:
                self.left.add(trainer)
        if self.members:
            return []
        done, self._all_left = self._all_left, []
        return done

    def stats(self) -> dict[str, object]:
        """The departed trainers and how long each was silent. Called with the lock held."""
        return {
            "departed": sorted(self.departed),
            "departed_after_silence_s": dict(sorted(self.silence_s.items())),
        }

    # ---- taking the lock ----

    def members_now(self) -> frozenset[int]:
        with self.lock:
            return frozenset(self.members)

    def wait_all_left(self) -> Future:
        """A future completed once every trainer has left."""
        with self.lock:
            if not self.members:
                return completed(None)
            future: Future = Future()
            self._all_left.append(future)
            return future

    def heartbeat(self, trainer: int, idle_s: float) -> Future:
        """Note that ``trainer`` is alive, its loop idle for ``idle_s`` seconds; answers what
        this server takes it to be (``member``, ``left`` or ``departed: REASON``). A member
        idle past the stall limit is stuck (in its data, say): it is departed now."""
        if type(trainer) is not int or not 0 <= trainer < self.num_trainers:
            return failed(ParamServerError(f"server {self.server}: unknown trainer {trainer!r}"))
        if type(idle_s) is not float or not 0.0 <= idle_s < float("inf"):
            return failed(ParamServerError(f"server {self.server}: bad idle time"))
        with self.lock:
            if trainer in self.departed:
                return completed(f"departed: {self.departed[trainer]}")
            self.seen(trainer)  # also after leaving: the chief beats until the job ends
            if trainer in self.left:
                return completed("left")
        if idle_s <= self.stall_limit:
            return completed("member")
        reason = f"it made no progress for {idle_s:.1f} s, stuck in its data or its loop"
        self._depart(trainer, reason)
        with self.lock:
            if trainer not in self.departed:  # its final push came first: it left
                return completed("left")
            self.silence_s[trainer] = idle_s
        log.warning("server %d: trainer %d departed: %s", self.server, trainer, reason)
        return completed(f"departed: {reason}")

    def depart_silent(self, now: float) -> None:
        """Declare departed the members silent past ``trainer_timeout`` at ``now``."""
        with self.lock:
            first = self._first_contact
            if first is None or self.paused:  # no trainer heard from yet, or none can be
                return
            silence = {t: now - self.last_seen.get(t, first) for t in sorted(self.members)}
            silent = [t for t, seconds in silence.items() if seconds > self.trainer_timeout]
            for t in silent:  # how long it had been silent: the detection time
                self.silence_s[t] = silence[t]
        for t in silent:
            self._depart(t, f"silent (no call, no heartbeat) for {silence[t]:.1f} s")

    def pause(self, paused: bool) -> None:
        """While ``paused`` no member is declared silent; once resumed, each counts as heard
        from now (the RPC world changed: see :func:`paramserver.transport.rpc.watch_restarts`)."""
        with self.lock:
            self.paused = paused
            if not paused:
                for trainer in self.members:
                    self.seen(trainer)

    def chief_lost(self) -> str | None:
        """Why the chief trainer, who ends the job, is lost (it departed, or went silent after
        leaving); None while it is not."""
        with self.lock:
            if 0 in self.departed:
                return f"it was declared departed: {self.departed[0]}"
            seen = self.last_seen.get(0)
            if 0 in self.left and seen is not None and not self.paused:
                silence = time.monotonic() - seen
                if silence > self.trainer_timeout:
                    return f"it went silent for {silence:.1f} s after its last push"
            return None


class Watchdog:
    """A daemon thread calling ``tick`` (a bound method, held weakly: the thread ends with its
    owner, or on :meth:`stop`) every :data:`WATCHDOG_PERIOD_S`; a failed tick is logged and
    retried at the next."""

    def __init__(self, tick: Callable[[], None], server: int):
        self._stopped = threading.Event()
        ref = weakref.WeakMethod(tick)
        stopped = self._stopped

        def watch() -> None:
            while not stopped.wait(WATCHDOG_PERIOD_S):
                target = ref()
                if target is None:
                    return
                try:
                    target()
                except Exception:  # keep watching: a missed tick is retried at the next
                    log.exception("server %d: liveness check failed", server)
                del target

        self._thread = threading.Thread(target=watch, name="paramserver-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; returns once it has ended (at once from the thread itself)."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
