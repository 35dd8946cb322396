"""A lost member's place in the RPC world is taken by a process started anew, and the
survivors keep what they hold: they leave the world at once and join the next generation's
(paramserver.transport.rpc: leave_lost_world, then start). Three processes on loopback; the
server is killed with SIGKILL."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import REPO, stop, wait_until

pytestmark = pytest.mark.system

MEMBER = Path(__file__).resolve().parent / "_rejoin_member.py"


def member(role: str, directory: Path, generation: int, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(MEMBER), role, str(directory), str(generation)],
        cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_survivors_rejoin_a_new_world_with_a_new_server_and_keep_their_state(
    tmp_path: Path,
) -> None:
    logs = {role: tmp_path / f"{role}.log" for role in ("server", "caller1", "caller2", "new")}
    first = member("server", tmp_path, 0, logs["server"])
    callers = [member(role, tmp_path, 0, logs[role]) for role in ("caller1", "caller2")]
    processes = [first, *callers]
    try:
        wait_until(
            lambda: all(logs[r].read_text().count("answered") >= 3 for r in ("caller1", "caller2")),
            60, "the callers to be answered",
        )  # fmt: skip
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        wait_until(lambda: all("lost" in logs[r].read_text() for r in ("caller1", "caller2")),
                   30, "the callers to see the server lost")  # fmt: skip
        new = member("server", tmp_path, 1, logs["new"])
        processes.append(new)
        for caller, role in zip(callers, ("caller1", "caller2"), strict=True):
            assert caller.wait(60) == 0, logs[role].read_text()
        assert new.wait(60) == 0, logs["new"].read_text()
    finally:
        stop(*processes)
    for role in ("caller1", "caller2"):
        text = logs[role].read_text()
        before = [int(n) for n in re.findall(r"^answered \d+ by (\d+)", text, re.M)]
        found = re.search(r"after rejoin answered (\d+) by (\d+), kept (\d+)", text)
        assert found is not None, text
        assert set(before) == {first.pid} and int(found[2]) == new.pid
        assert int(found[1]) == int(found[3]) == len(before)  # its count went on from where it was
