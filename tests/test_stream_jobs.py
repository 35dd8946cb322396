"""Whole jobs on a Redis stream (a real redis-server on loopback, the processes launcher): a
trainer SIGKILLed mid-job restarts the job from its checkpoint and every record handed out is
trained on exactly once; SIGTERM stops a job cleanly with a final checkpoint, from which a
resume reads on.

Each record carries its number in categorical column C26 (``produce --record-ids``), so the
C26 table holds one row per record trained, and Adam's per-row step count says how many times
each was applied."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from paramserver.checkpoint import load_latest
from paramserver.checkpoint.store import committed_steps
from paramserver.data.criteo import NUM_CATEGORICAL, hash_categorical
from paramserver.streams import RedisStream
from paramserver.streams.produce import produce, synthetic_lines
from tests.procs import REPO, RedisServer, children_of_launcher, rank_pid, stop, wait_until

pytestmark = pytest.mark.system

BATCH = 64
RECORD_TABLE = f"embeddings.{NUM_CATEGORICAL - 1}.weight"  # C26: the record's number


def start_job(url: str, root: Path, *flags: str) -> subprocess.Popen[str]:
    job = ("--launcher", "processes", "--servers", "2", "--trainers", "2", "--mode", "sync")
    reading = ("--dataset", f"stream:{url}", "--batch-size", str(BATCH), "--optimizer", "adam")
    saving = ("--checkpoint-dir", str(root / "ckd"), "--checkpoint-every", "5")
    return subprocess.Popen(
        [sys.executable, "-m", "paramserver", "train", *job, *reading, *saving, *flags],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(job: subprocess.Popen[str], timeout: float = 120) -> str:
    try:
        output, _ = job.communicate(timeout=timeout)
    finally:
        stop(job)
    assert job.returncode == 0, output
    return output


def record_counts(root: Path) -> dict[int, int]:
    """How many times each record's row in the final checkpoint was updated, by row id."""
    found = load_latest(root / "ckd")
    assert found is not None and found.meta.get("final")
    counts: dict[int, int] = {}
    for server in (0, 1):
        tensors, _ = found.read_part(f"server-{server}")
        ids, steps = tensors[f"table/{RECORD_TABLE}/ids"], tensors[f"table/{RECORD_TABLE}/steps"]
        counts.update(zip(ids.tolist(), steps.long().tolist(), strict=True))
    return counts


def handed_out_not_trained(source: RedisStream, ends: dict[str, Any]) -> set[str]:
    """Entries a trainer was handed after its final position: pending, not in the model."""
    client = source.connect()
    left: set[str] = set()
    for trainer, end in ends.items():
        pending = client.xpending_range(
            source.stream, source.group, "-", "+", 10**6, consumername=f"trainer-{trainer}"
        )
        after = _entry_key(end["input_position"]["id"])
        left |= {
            p["message_id"].decode()
            for p in pending
            if _entry_key(p["message_id"].decode()) > after
        }
    return left


def _entry_key(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def delivered_records(source: RedisStream) -> dict[str, int]:
    """Every entry the group handed out, with its record's row id in the C26 table."""
    client = source.connect()
    group = next(g for g in client.xinfo_groups(source.stream) if g["name"] == b"paramserver")
    entries = client.xrange(source.stream, "-", group["last-delivered-id"])
    numbers = torch.tensor([int(fields[b"line"].rsplit(b"\t", 1)[1], 16) for _, fields in entries])
    columns = torch.zeros(len(entries), NUM_CATEGORICAL, dtype=torch.int64)
    columns[:, -1] = numbers
    rows = hash_categorical(columns)[:, -1].tolist()
    return {entry_id.decode(): row for (entry_id, _), row in zip(entries, rows, strict=True)}


def assert_trained_exactly_once(source: RedisStream, root: Path) -> None:
    counts = record_counts(root)
    assert set(counts.values()) == {1}, "a record trained on twice"
    found = load_latest(root / "ckd")
    assert found is not None
    ends = found.meta["stream_ends"]
    assert len(counts) == sum(end["steps_done"] for end in ends.values()) * BATCH
    delivered = delivered_records(source)
    untrained = handed_out_not_trained(source, ends)
    expected = {row for entry, row in delivered.items() if entry not in untrained}
    assert set(counts) == expected, "a record handed out before a trainer's end not trained"


def stream_of(redis_server: RedisServer, name: str, records: int) -> RedisStream:
    source = RedisStream.from_url(redis_server.url(name))
    produce(source, synthetic_lines(records, record_ids=True))
    return source


@pytest.mark.timeout(240)
def test_a_trainer_killed_mid_job_restarts_it_and_every_record_counts_once(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    source = stream_of(redis_server, "killed", 40 * 2 * BATCH + 4000)
    job = start_job(source.name, tmp_path, "--steps", "40", "--max-restarts", "1")
    try:
        wait_until(lambda: committed_steps(tmp_path / "ckd"), 90, "a first checkpoint")
        trainer1 = 3  # its rank: after the two servers
        os.kill(rank_pid(trainer1, launcher=job.pid), signal.SIGKILL)
        output = finish(job)
    finally:
        stop(job)
    assert "restarting the job (1 of 1) from its newest checkpoint" in output
    found = load_latest(tmp_path / "ckd")
    assert found is not None and [e["steps_done"] for e in found.meta["stream_ends"].values()] == [
        40,
        40,
    ]
    assert_trained_exactly_once(source, tmp_path)


@pytest.mark.timeout(240)
def test_sigterm_stops_a_stream_job_with_a_final_checkpoint_that_a_resume_reads_on_from(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    source = stream_of(redis_server, "stopped", 300 * 2 * BATCH)
    job = start_job(source.name, tmp_path, "--max-restarts", "0")
    try:
        wait_until(lambda: committed_steps(tmp_path / "ckd"), 90, "a first checkpoint")
        children = children_of_launcher(job.pid)
        job.send_signal(signal.SIGTERM)
        output = finish(job, timeout=60)
    finally:
        stop(job)
    assert "stopping: every trainer ends its input at its next step" in output
    assert all(not Path(f"/proc/{pid}").exists() for pid in children), "a process left behind"
    found = load_latest(tmp_path / "ckd")
    assert found is not None and found.meta.get("final")
    ends = found.meta["stream_ends"]
    assert sorted(ends) == ["0", "1"]
    # Each trainer stops at its next step: in sync mode one may take a step the other did not.
    stopped_at = max(end["steps_done"] for end in ends.values())
    assert (
        0 < stopped_at < 300 and min(end["steps_done"] for end in ends.values()) >= stopped_at - 1
    )
    finish(start_job(source.name, tmp_path, "--resume", "--steps", str(stopped_at + 3)))
    resumed = load_latest(tmp_path / "ckd")
    assert resumed is not None and resumed.step > found.step
    assert [end["steps_done"] for end in resumed.meta["stream_ends"].values()] == [
        stopped_at + 3
    ] * 2
    assert_trained_exactly_once(source, tmp_path)
