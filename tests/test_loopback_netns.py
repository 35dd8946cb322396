"""A local job opens no port beyond loopback, from its first moment, even on a host whose
hostname resolves to a network address (most containers and cloud VMs).

The job runs in fresh network, UTS and mount namespaces made to look like such a host (see
tests/_netns_job.py), so nothing it opens is reachable from outside them. Needs root, util-linux's
``unshare`` and iproute2; skips with the reason where the namespaces cannot be made.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests._netns_job import HOST_ADDRESS
from tests.procs import REPO, SMALL_JOB, is_loopback

pytestmark = pytest.mark.system  # starts processes or whole jobs: the system tier

NAMESPACES = ["unshare", "--net", "--uts", "--mount"]


def namespaces_unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    for tool in ("unshare", "ip", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    tried = subprocess.run([*NAMESPACES, "true"], capture_output=True, text=True, timeout=30)
    if tried.returncode != 0:
        return f"cannot create namespaces here: {tried.stderr.strip()}"
    return None


@pytest.mark.timeout(240)
def test_a_local_job_never_listens_beyond_loopback_where_the_hostname_resolves_outward(
    tmp_path: Path,
) -> None:
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "sockets.json"
    # The trainers' all-reduce group listens too (--dense-sync allreduce), beside the RPC world.
    train = [*SMALL_JOB, "--servers", "2", "--trainers", "2", "--train-batches", "40"]
    train += ["--dense-sync", "allreduce"]
    poller = [sys.executable, "-m", "tests._netns_job", str(out), *train, "--no-progress"]
    subprocess.run([*NAMESPACES, *poller], cwd=REPO, check=True, timeout=200)
    result = json.loads(out.read_text())
    if result.get("skip"):
        pytest.skip(result["skip"])
    assert result["returncode"] == 0, result["output_tail"]
    samples = result["samples"]
    # Not vacuous: the poller saw every rank's process and their sockets while the job ran.
    assert max(s["processes"] for s in samples) == 1 + 4, samples
    seen = {address for s in samples for address in s["listening"]}
    # 8 are the RPC world's (TensorPipe and its gloo group); more, the trainers' group's.
    assert len(seen) >= 9, f"saw too few listening sockets to judge: {sorted(seen)}"
    beyond = [(s["at_s"], a) for s in samples for a in s["listening"] if not is_loopback(a)]
    assert beyond == [], f"listened beyond loopback (the host is {HOST_ADDRESS}): {beyond}"
