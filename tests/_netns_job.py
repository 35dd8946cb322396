"""Run a local job on a host whose hostname resolves to a network address, and record every
socket it listens on, from its first moment to its last.

Run inside ``unshare --net --uts --mount`` (root): ``python -m tests._netns_job OUT.json
TRAIN_ARGS...``. It makes the fresh namespaces look like a container or cloud VM (``lo`` up, a
veth end holding the documentation address 192.0.2.2, a hostname that resolves to it through a
hosts file bind-mounted over ``/etc/hosts``), starts ``paramserver train TRAIN_ARGS`` and,
every POLL_S until the job exits, lists the listening TCP sockets of the launcher and every
process it started. ``/proc/net/tcp`` shows the sockets of the reader's network namespace, so
the polling has to happen in here. Writes ``{"skip": reason}`` when the namespace cannot be
set up, else the samples, the job's exit status and its output's tail. Used by
tests/test_loopback_netns.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.procs import children_of_launcher, listening_addresses

HOST_ADDRESS = "192.0.2.2"  # TEST-NET-1 (RFC 5737): routes nowhere
HOSTNAME = "psnetns"
POLL_S = 0.05  # Gloo listened for ~0.17 s while the ranks joined: sample it several times
JOB_LIMIT_S = 150.0


def become_networked_host(scratch: Path) -> str | None:
    """Set this process's namespaces up; the reason it could not, or None."""
    steps = [
        ["ip", "link", "set", "lo", "up"],
        ["ip", "link", "add", "psnet0", "type", "veth", "peer", "name", "psnet1"],
        ["ip", "addr", "add", f"{HOST_ADDRESS}/24", "dev", "psnet0"],
        ["ip", "link", "set", "psnet0", "up"],
        ["ip", "link", "set", "psnet1", "up"],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            return f"{' '.join(step)} failed: {done.stderr.strip()}"
    socket.sethostname(HOSTNAME)
    hosts = scratch / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n{HOST_ADDRESS} {HOSTNAME}\n")
    mounted = subprocess.run(
        ["mount", "--bind", str(hosts), "/etc/hosts"], capture_output=True, text=True, timeout=30
    )
    if mounted.returncode != 0:
        return f"cannot bind-mount a hosts file over /etc/hosts: {mounted.stderr.strip()}"
    resolved = socket.gethostbyname(socket.gethostname())
    if resolved != HOST_ADDRESS:
        return f"the hostname resolves to {resolved}, not {HOST_ADDRESS}"
    return None


def kill_job(job: subprocess.Popen[bytes]) -> None:
    """SIGKILL the launcher and what it started, by pid."""
    for pid in [*children_of_launcher(job.pid), job.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    job.wait(timeout=30)


def run_and_poll(train_args: list[str], scratch: Path) -> dict[str, object]:
    log_path = scratch / "job.log"
    samples: list[dict[str, object]] = []
    with log_path.open("wb") as log:  # a file, not a pipe: a full pipe would stall the job
        started = time.monotonic()
        job = subprocess.Popen(
            [sys.executable, "-m", "paramserver", "train", *train_args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            while job.poll() is None:
                if time.monotonic() - started > JOB_LIMIT_S:
                    kill_job(job)
                    break
                pids = [job.pid, *children_of_launcher(job.pid)]
                samples.append(
                    {
                        "at_s": round(time.monotonic() - started, 3),
                        "processes": len(pids),
                        "listening": listening_addresses(pids),
                    }
                )
                time.sleep(POLL_S)
        finally:
            if job.poll() is None:
                kill_job(job)
    return {
        "returncode": job.returncode,
        "samples": samples,
        "output_tail": log_path.read_text(errors="replace")[-3000:],
    }


def main(argv: list[str]) -> int:
    out, train_args = Path(argv[0]), argv[1:]
    with tempfile.TemporaryDirectory(prefix="paramserver-netns-") as scratch:
        reason = become_networked_host(Path(scratch))
        result = {"skip": reason} if reason else run_and_poll(train_args, Path(scratch))
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
