"""Whole jobs on a Redis stream (a real redis-server on loopback, the processes launcher): a
trainer SIGKILLed mid-job restarts the job from its checkpoint and every record handed out is
trained on exactly once; SIGTERM stops a job cleanly with a final checkpoint, whose entries are
acknowledged before it exits (those read ahead stay pending), from which a resume reads on. In
one process (the threads launcher): the final checkpoint's acknowledgement, and Redis frozen
just then (logged, the job ends well, the resume acknowledges).

Each record carries its number in categorical column C26 (``produce --record-ids``), so the
C26 table holds one row per record trained, and Adam's per-row step count says how many times
each was applied."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import paramserver as ps
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


def pending_by_trainer(source: RedisStream, ends: dict[str, Any]) -> dict[str, list[str]]:
    """Each trainer's consumer's pending entries (their ids), by trainer."""
    client = source.connect()
    return {
        trainer: [
            p["message_id"].decode()
            for p in client.xpending_range(
                source.stream, source.group, "-", "+", 10**6, consumername=f"trainer-{trainer}"
            )
        ]
        for trainer in ends
    }


def handed_out_not_trained(source: RedisStream, ends: dict[str, Any]) -> set[str]:
    """Entries a trainer was handed after its final position: pending, not in the model."""
    return {
        entry
        for trainer, pending in pending_by_trainer(source, ends).items()
        for entry in pending
        if _entry_key(entry) > _entry_key(ends[trainer]["input_position"]["id"])
    }


def assert_no_trained_entry_pending(source: RedisStream, ends: dict[str, Any]) -> set[str]:
    """Every entry the final checkpoint holds is acknowledged: each consumer's pending entries
    all come after its trainer's end, and they are all the group has pending (XINFO GROUPS).
    Returns them (read ahead, not trained)."""
    pending = pending_by_trainer(source, ends)
    for trainer, entries in pending.items():
        end = _entry_key(ends[trainer]["input_position"]["id"])
        trained = [entry for entry in entries if _entry_key(entry) <= end]
        assert not trained, f"trainer {trainer}: {len(trained)} trained entries still pending"
    untrained = handed_out_not_trained(source, ends)
    group = next(
        g for g in source.connect().xinfo_groups(source.stream) if g["name"] == b"paramserver"
    )
    assert group["pending"] == len(untrained)
    return untrained


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
    # Each trainer holds up to about 7 reads (1024 entries) it has not trained (read ahead, and
    # what it was handed before the kill): the other must still find its 40 steps.
    source = stream_of(redis_server, "killed", 40 * 2 * BATCH + 12_000)
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
    source = stream_of(redis_server, "stopped", 500 * 2 * BATCH)  # enough for the resume
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
    # The final checkpoint's entries are acknowledged before the job exits; those read ahead
    # stay pending (read ahead: a few reads of 1024 entries each, so some always are).
    read_ahead = assert_no_trained_entry_pending(source, ends)
    assert read_ahead, "no entry read ahead: the resume below would show nothing"
    # The resume reads them first (each trainer its own), then new ones: far enough to train
    # every one of them.
    most = max(len(entries) for entries in pending_by_trainer(source, ends).values())
    steps = stopped_at + -(-most // BATCH) + 1
    finish(start_job(source.name, tmp_path, "--resume", "--steps", str(steps)))
    resumed = load_latest(tmp_path / "ckd")
    assert resumed is not None and resumed.step > found.step
    assert [end["steps_done"] for end in resumed.meta["stream_ends"].values()] == [steps] * 2
    assert_no_trained_entry_pending(source, resumed.meta["stream_ends"])
    assert_trained_exactly_once(source, tmp_path)
    delivered = delivered_records(source)
    assert {delivered[entry] for entry in read_ahead} <= set(record_counts(tmp_path))


# --- In one process: the final checkpoint's acknowledgement -----------------------------------

STEPS = 6  # 384 records: the first read (1024 entries) leaves some read ahead


def numbers(records: Sequence[bytes]) -> tuple[Any, list[str | None]]:
    """Records that are decimal numbers: each one's id, and a float target."""
    good = torch.tensor([int(r) for r in records])
    return (good, good.float()), [None] * len(records)


class ByNumber(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rows = nn.Embedding(4096, 1)

    def forward(self, ids: Tensor) -> Tensor:
        return self.rows(ids).squeeze(1)


def numbers_stream(server: RedisServer, name: str) -> RedisStream:
    source = RedisStream.from_url(server.url(name), batch_size=BATCH, decoder=numbers, block_ms=50)
    source.check()
    produce(source, (str(i).encode() for i in range(4096)))
    return source


def train_to_the_end(source: RedisStream, root: Path, after_input: Callable[[], None]) -> Any:
    """A one-trainer job of ``STEPS`` steps on ``source`` with a final checkpoint only;
    ``after_input()`` runs once the trainer's input is closed, before the job ends. Returns
    the trainer's end position."""

    def loop(ctx: ps.TrainContext) -> None:
        for ids, target in ctx.batches(source(ctx.rank, ctx.num_trainers)):
            loss = nn.functional.mse_loss(ctx.model(ids), target)
            loss.backward()
            ctx.step(loss.detach())
        after_input()

    config = ps.TrainConfig(
        servers=1, trainers=1, launcher="threads", steps=STEPS, checkpoint_dir=str(root / "ckd"),
        stream_input=True, progress=False,
    )  # fmt: skip
    ps.run(ByNumber, loop, config)
    found = load_latest(root / "ckd")
    assert found is not None and found.meta.get("final")
    position = found.meta["stream_ends"]["0"]["input_position"]
    assert position["records"] == STEPS * BATCH
    return position


def pending_ids(source: RedisStream) -> list[int]:
    """The records of the entries pending in the group, as numbers."""
    client = source.connect()
    pending = client.xpending_range(source.stream, source.group, "-", "+", 10**6)
    entries = [client.xrange(source.stream, p["message_id"], p["message_id"]) for p in pending]
    return [int(entry[0][1][b"line"]) for entry in entries]


def read_on(source: RedisStream, position: Any, batches: int) -> list[int]:
    """What a resumed trainer reads first: ``batches`` batches after ``position``."""
    reader = source(0, 1)
    reader.seek(position)
    got = [int(x) for batch in itertools.islice(reader, batches) for x in batch[0]]
    reader.close()
    return got


@pytest.mark.timeout(120)
def test_the_final_checkpoint_s_entries_are_acknowledged_and_those_read_ahead_read_again(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    source = numbers_stream(redis_server, "final-ack")
    position = train_to_the_end(source, tmp_path, lambda: None)
    trained = STEPS * BATCH
    read_ahead = pending_ids(source)
    assert read_ahead and min(read_ahead) == trained, "a trained entry left pending"
    # A resume reads the read-ahead entries again, in order, then new ones: none twice.
    assert read_on(source, position, 20) == list(range(trained, trained + 20 * BATCH))


@pytest.mark.timeout(120)
def test_redis_frozen_at_the_final_acknowledgement_is_logged_and_the_resume_acknowledges(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = RedisServer(tmp_path)
    frozen = False

    def freeze() -> None:  # Redis stops answering, its connections open: every wait times out
        nonlocal frozen
        os.kill(server.process.pid, signal.SIGSTOP)
        frozen = True

    try:
        source = numbers_stream(server, "frozen")
        with caplog.at_level(logging.INFO, logger="paramserver"):
            position = train_to_the_end(source, tmp_path, freeze)
        os.kill(server.process.pid, signal.SIGCONT)
        frozen = False
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(
            "the stream entries it holds are not acknowledged" in m
            and f"{source.name}: Redis unreachable for 5 s" in m
            and "they stay pending until a job resumed from it starts" in m
            for m in warned
        ), warned
        trained = STEPS * BATCH
        assert sorted(pending_ids(source))[:trained] == list(range(trained))  # not acknowledged
        assert read_on(source, position, 1) == list(range(trained, trained + BATCH))
        assert min(pending_ids(source)) == trained  # the resume acknowledged them
    finally:
        if frozen:
            os.kill(server.process.pid, signal.SIGCONT)
        server.stop()
