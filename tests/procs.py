"""Finding the processes a job started, and their listening sockets, through /proc."""

from __future__ import annotations

import os
from pathlib import Path


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
