"""The processes of tests' jobs: a small CLI job, finding what a job started (through /proc),
its listening sockets, waiting on it and stopping it. Tests kill only pids found here."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
# CLI flags for a built-in job small enough for a test.
SMALL_JOB = ("--rows-per-table", "2000", "--eval-samples", "4096", "--batch-size", "256")


def free_port() -> int:
    """A TCP port on 127.0.0.1 free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(condition: Callable[[], T | None], timeout: float, what: str) -> T:
    """Poll ``condition`` (another process's doing: nothing to wait on) until it returns a true
    value, and return that value."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


def children_of_launcher(launcher_pid: int) -> list[int]:
    """Pids of live processes started by the paramserver launcher ``launcher_pid``."""
    marker = f"PARAMSERVER_LAUNCHER_PID={launcher_pid}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == launcher_pid:
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in environ and state != "Z":
            found.append(int(entry.name))
    return found


def listening_addresses(pids: list[int]) -> list[str]:
    """``ip:port`` of every TCP socket in LISTEN state owned by one of ``pids``."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    addresses = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:
                addresses.append(decode_address(local, width))
    return addresses


def decode_address(hex_address: str, width: int) -> str:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if width == 8:
        ip = ".".join(str(b) for b in raw[::-1])
    else:  # IPv6: four little-endian 32-bit words
        words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
        ip = ":".join(b"".join(words)[i : i + 2].hex() for i in range(0, 16, 2))
    return f"{ip}:{int(port, 16)}"


def is_loopback(address: str) -> bool:
    ip = address.rsplit(":", 1)[0]
    return (
        ip.startswith("127.")
        or ip == "0000:0000:0000:0000:0000:0000:0000:0001"
        or ip.startswith("0000:0000:0000:0000:0000:ffff:7f")
    )


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` (R running, S sleeping, T stopped, Z zombie...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def rank_pid(rank: int, launcher: int | None = None) -> int:
    """The pid of rank ``rank`` of the local job launched by ``launcher`` (this process by
    default)."""
    module = b"paramserver.launch.worker"
    for pid in children_of_launcher(os.getpid() if launcher is None else launcher):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if module in argv and argv[argv.index(module) + 2] == str(rank).encode():
            return pid
    raise AssertionError(f"no process for rank {rank}")


def descendants(pid: int) -> list[int]:
    """Pids of every live process below ``pid`` (torchrun's workers may leave its group)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def stop(*processes: subprocess.Popen[Any]) -> None:
    """Kill what a test started, by pid: each process and everything below it."""
    for process in processes:
        for pid in [*descendants(process.pid), process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait(timeout=30)


def vm_kib(field: str) -> int:
    """A field of this process's /proc/self/status, in KiB (``VmRSS``, ``VmHWM``...)."""
    with open("/proc/self/status") as status:
        found = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    assert found is not None, field
    return int(found.group(1))


def reset_peak() -> None:
    """Make VmHWM (the peak resident size) the current size (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


class RedisServer:
    """A real redis-server on a free loopback port, its data in ``directory`` and nowhere
    else (no snapshot, no append-only file); stopped by its pid."""

    def __init__(self, directory: Path):
        binary = shutil.which("redis-server")
        if binary is None:
            raise AssertionError(
                "redis-server is not installed: the stream tests run a real one (`make test` "
                "installs Debian's package: apt-get install redis-server)"
            )
        self.port = free_port()
        settings = {"bind": "127.0.0.1", "save": "", "appendonly": "no", "dir": str(directory)}
        flags = [part for name, value in settings.items() for part in (f"--{name}", value)]
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), *flags],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(self._answers, 20, f"redis-server on port {self.port}")

    def url(self, stream: str) -> str:
        return f"redis://127.0.0.1:{self.port}/{stream}"

    def _answers(self) -> bool:
        with socket.socket() as s:
            s.settimeout(1)
            try:
                s.connect(("127.0.0.1", self.port))
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
            except OSError:
                return False

    def stop(self) -> None:
        stop(self.process)
