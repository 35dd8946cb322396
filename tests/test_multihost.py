"""Two "hosts" as Linux network namespaces joined by a veth pair, each running torchrun as a
real host would: servers on one, trainers on the other. A job runs across them; cutting the
link is handled like a death (the job stops with an error, no process left behind).

Needs root and iproute2 (CI runs as root); skips with the reason where a namespace cannot be
created. Traffic stays inside the namespaces this test creates.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from paramserver.checkpoint import load_latest
from tests.procs import REPO, SMALL_JOB, stop, wait_until

pytestmark = pytest.mark.system  # starts processes or whole jobs: the system tier

SUBNET = "10.213.77"


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def hosts() -> Iterator[tuple[str, str]]:
    """Two namespaces, ``A`` at .1 and ``B`` at .2, linked by a veth pair."""
    tag = str(os.getpid())
    a, b = f"psA{tag}", f"psB{tag}"
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (ip) is not installed")
    made = ip("netns", "add", a)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {made.stderr.strip()}")
    try:
        ip("netns", "add", b).check_returncode()
        ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}").check_returncode()
        for ns, dev, host in ((a, f"va{tag}", 1), (b, f"vb{tag}", 2)):
            ip("link", "set", dev, "netns", ns).check_returncode()
            ip("-n", ns, "addr", "add", f"{SUBNET}.{host}/24", "dev", dev).check_returncode()
            ip("-n", ns, "link", "set", dev, "up").check_returncode()
            ip("-n", ns, "link", "set", "lo", "up").check_returncode()
        yield a, b
    finally:
        ip("netns", "del", a)
        ip("netns", "del", b)


def torchrun(
    ns: str, device: str, node_rank: int, port: int, out: Path, *extra: str
) -> subprocess.Popen[str]:
    env = dict(os.environ, TP_SOCKET_IFNAME=device, GLOO_SOCKET_IFNAME=device)
    command = [
        "ip", "netns", "exec", ns,
        str(Path(sys.executable).with_name("torchrun")),
        "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node_rank),
        "--master-addr", f"{SUBNET}.1", "--master-port", str(port), "--rdzv-backend", "static",
        "-m", "paramserver", "train", "--servers", "2", "--trainers", "2", *SMALL_JOB,
        "--no-progress", "--summary-json", str(out), *extra,
    ]  # fmt: skip
    return subprocess.Popen(
        command, cwd=REPO, env=env, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


@pytest.mark.timeout(240)
def test_a_job_runs_across_two_hosts_and_a_cut_link_stops_it(
    hosts: tuple[str, str], tmp_path: Path
) -> None:
    a, b = hosts
    tag = str(os.getpid())
    summary = tmp_path / "summary.json"
    servers = torchrun(a, f"va{tag}", 0, 29611, tmp_path / "unused.json", "--train-batches", "40")
    trainers = torchrun(b, f"vb{tag}", 1, 29611, summary, "--train-batches", "40")
    try:
        out_b, _ = trainers.communicate(timeout=150)
        out_a, _ = servers.communicate(timeout=60)
    finally:
        stop(servers, trainers)
    assert trainers.returncode == 0 and servers.returncode == 0, out_a + out_b
    result = json.loads(summary.read_text())
    assert result["servers"] == 2 and sum(result["trainer_steps"]) == 40

    # Again, and cut the link while it trains: both hosts stop, with an error, in seconds.
    checkpoints = tmp_path / "ckd"
    slow = (
        "--train-batches", "100000", "--trainer-timeout", "3", "--heartbeat-interval", "0.5",
        "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "20",
    )  # fmt: skip
    servers = torchrun(a, f"va{tag}", 0, 29612, tmp_path / "unused2.json", *slow)
    trainers = torchrun(b, f"vb{tag}", 1, 29612, tmp_path / "never.json", *slow)
    try:
        # A committed checkpoint: the job is up on both hosts and training.
        wait_until(lambda: load_latest(checkpoints) is not None, 60, "the first checkpoint")
        assert trainers.poll() is None and servers.poll() is None
        ip("-n", b, "link", "set", f"vb{tag}", "down").check_returncode()
        cut_at = time.monotonic()
        out_b, _ = trainers.communicate(timeout=90)
        out_a, _ = servers.communicate(timeout=90)
        stopped_in = time.monotonic() - cut_at
    finally:
        stop(servers, trainers)
    assert trainers.returncode != 0 and servers.returncode != 0
    # Said by the transport's call timeout or by the heartbeats' own clock, whichever is first.
    assert re.search(r"did not answer (a )?heartbeat within", out_b), out_b[-2000:]
    assert "the chief trainer (trainer0) is lost" in out_a, out_a[-2000:]
    assert stopped_in < 60
    assert not (tmp_path / "never.json").exists()
