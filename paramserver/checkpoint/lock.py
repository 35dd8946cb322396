"""One job per checkpoint directory: a lock file that names the job holding ``ROOT``.

Two jobs committing into one ``ROOT`` would delete each other's parts and move ``LATEST`` to
each other's steps, so a job holds ``ROOT/LOCK`` from its start to its end. The file is JSON:
the job id (a random token, also written into every manifest the job commits), the host name,
the pid of the holding process and that process's start time, and when it was taken.

Who holds it: the process whose life is the job's. The local launchers hold it in the launching
process, so a job that ``--max-restarts`` restarts keeps it; its trainer processes commit under
it (:func:`committer_job` accepts the launcher that started them). Under torchrun the chief
trainer's rank holds it: when torchrun restarts the group, the dead chief's lock is stale.

A lock is *stale*, and taken over with a warning, when its process is gone: same host, and no
process with that pid and start time is running (a zombie counts as gone). A lock from another
host cannot be judged from here: the error says which host and pid hold it and that the file
may be deleted once that job is known to have ended. A garbled lock file is stale.

Taking, replacing and releasing the file happen under ``flock`` on ``ROOT/.LOCK.guard``, so two
jobs that start together cannot both take a free or stale lock. Local disks and NFS (which
maps ``flock`` to its own locks) honour it; a file system without it still refuses every
second job that starts after the first has written its lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any

from paramserver.errors import CheckpointError

log = logging.getLogger(__name__)

LOCK = "LOCK"
GUARD = ".LOCK.guard"
GUARD_WAIT_S = 10.0
LAUNCHER_PID_ENV = "PARAMSERVER_LAUNCHER_PID"  # set by the processes launcher in its children

# Roots this process holds, resolved path -> job id: a second job in this same process (the
# threads launcher) is refused like any other live job.
_held: dict[str, str] = {}
_held_lock = threading.Lock()


@dataclass(frozen=True)
class Holder:
    """What ``ROOT/LOCK`` says about the job holding it."""

    job_id: str
    host: str
    pid: int
    pid_started: int | None  # the process's start time in clock ticks (Linux); None elsewhere
    since: str  # when the lock was taken, ISO 8601 UTC

    def describe(self) -> str:
        return f"job {self.job_id} (pid {self.pid} on host {self.host}, since {self.since})"


class DirectoryLock:
    """A held lock on a checkpoint root; :meth:`release` (or leaving a ``with``) gives it up."""

    def __init__(self, root: Path, holder: Holder):
        self.root = root
        self.holder = holder
        self._released = False

    @property
    def job_id(self) -> str:
        return self.holder.job_id

    def release(self) -> None:
        """Delete the lock file if it is still this job's; again is a no-op."""
        if self._released:
            return
        self._released = True
        with _held_lock:
            _held.pop(_key(self.root), None)
        try:
            with _guard(self.root):
                found = read_holder(self.root)
                if found is not None and found.job_id == self.job_id:
                    (self.root / LOCK).unlink()
                else:
                    log.warning(
                        "%s: the lock of job %s was replaced while it ran (now: %s)",
                        self.root,
                        self.job_id,
                        found.describe() if found else "no lock",
                    )
        except (OSError, CheckpointError) as error:  # a dead pid leaves it stale: next job takes it
            log.warning(
                "%s: could not release the lock of job %s: %s", self.root, self.job_id, error
            )

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()


def lock_directory(root: str | os.PathLike[str]) -> DirectoryLock:
    """Take ``ROOT/LOCK`` for a new job (creating ``root`` if needed), taking over a stale one.

    Raises :class:`CheckpointError` naming the directory and the holder if another live job
    holds it, or one on another host that cannot be checked from here. Blocks at most
    ``GUARD_WAIT_S`` for a concurrent lock operation.
    """
    root = Path(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"checkpoint directory {root}: cannot create it: {e}") from e
    holder = Holder(
        job_id=secrets.token_hex(8),
        host=socket.gethostname(),
        pid=os.getpid(),
        pid_started=_started(os.getpid()),
        since=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    with _guard(root):
        found = read_holder(root)
        if found is not None:
            busy = _why_live(found)
            if busy is not None:
                raise CheckpointError(
                    f"checkpoint directory {root} is in use by {found.describe()}: {busy}. "
                    "Two jobs must not share a --checkpoint-dir (their commits would delete each "
                    "other's checkpoints): wait for that job to end, or choose another directory"
                )
            log.warning("%s: taking over the stale lock of %s", root, found.describe())
        _write_lock_file(root, holder)
        with _held_lock:
            _held[_key(root)] = holder.job_id
    log.info("%s: locked for job %s", root, holder.job_id)
    return DirectoryLock(root, holder)


def read_holder(root: str | os.PathLike[str]) -> Holder | None:
    """The job that ``ROOT/LOCK`` names; None if there is no lock file. A garbled one (from a
    tool that wrote it by hand) reads as a holder that no process matches: stale."""
    path = Path(root) / LOCK
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    try:
        document: Any = json.loads(raw)
        holder = Holder(**document)
        if not (
            isinstance(holder.job_id, str)
            and isinstance(holder.host, str)
            and type(holder.pid) is int
            and (holder.pid_started is None or type(holder.pid_started) is int)
            and isinstance(holder.since, str)
        ):
            raise TypeError("a field has the wrong type")
    except (ValueError, TypeError, RecursionError) as e:
        log.warning("%s: unreadable lock file (%s)", path, e)
        return Holder("unknown", socket.gethostname(), -1, None, "unknown")
    return holder


def committer_job(root: str | os.PathLike[str]) -> str | None:
    """The id of the job this process commits for: that of ``ROOT/LOCK`` when this process or
    the local launcher that started it holds it; None when there is no lock, or a stale one
    (the store used on its own). Raises :class:`CheckpointError` when another job holds it."""
    found = read_holder(root)
    if found is None:
        return None
    mine = {os.getpid()}
    with contextlib.suppress(KeyError, ValueError):
        mine.add(int(os.environ[LAUNCHER_PID_ENV]))
    if found.host == socket.gethostname() and found.pid in mine:
        return found.job_id
    busy = _why_live(found)
    if busy is None:
        return None
    raise CheckpointError(
        f"checkpoint directory {root} is held by {found.describe()}: {busy}; this process "
        f"(pid {os.getpid()}) does not commit for that job"
    )


def _why_live(holder: Holder) -> str | None:
    """Why ``holder`` may still be running; None if it is known to be gone."""
    if holder.host != socket.gethostname():
        return (
            f"it runs on another host, so whether it still runs cannot be checked from "
            f"{socket.gethostname()}; if that job has ended, delete its lock file {LOCK}"
        )
    if holder.pid == os.getpid():
        with _held_lock:
            held = holder.job_id in _held.values()
        return "another job of this same process holds it" if held else None
    if holder.pid <= 0 or not _running(holder.pid):
        return None
    started = _started(holder.pid)
    if holder.pid_started is not None and started is not None and started != holder.pid_started:
        return None  # the pid was reused by a later process
    return "that process is running"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    try:  # a zombie exists until reaped, but its job is over
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def _started(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), None if unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return int(fields[19])  # field 22 of stat; the two before ")" are pid and name
    except (OSError, IndexError, ValueError):
        return None


@contextlib.contextmanager
def _guard(root: Path) -> Iterator[None]:
    """Exclusive ``flock`` on ``ROOT/.LOCK.guard`` for a lock operation of a few ms."""
    try:
        fd = os.open(root / GUARD, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise CheckpointError(f"{root / GUARD}: cannot open: {e}") from e
    try:
        deadline = time.monotonic() + GUARD_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno in (errno.ENOLCK, errno.ENOTSUP, errno.EOPNOTSUPP):
                    break  # no flock on this file system: the lock file alone protects
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise CheckpointError(f"{root / GUARD}: cannot lock: {e}") from e
                if time.monotonic() > deadline:
                    raise CheckpointError(
                        f"{root / GUARD}: another process kept it locked for {GUARD_WAIT_S:g} s"
                    ) from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the flock


def _write_lock_file(root: Path, holder: Holder) -> None:
    """Replace ``ROOT/LOCK`` atomically: a reader sees the old holder or the new one."""
    tmp = root / f".{LOCK}.{secrets.token_hex(8)}.tmp"
    try:
        with open(tmp, "xb") as f:
            f.write((json.dumps(asdict(holder), indent=1) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / LOCK)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise CheckpointError(f"{root / LOCK}: cannot write: {e}") from e


def _key(root: Path) -> str:
    return str(root.resolve())
