"""Training input from a Redis stream, against a real redis-server on loopback: records cut into
batches that know their position, a consumer group sharing the stream, a reader resumed at its
position reading on with no duplicate and no gap, bad records skipped and counted, Redis
unreachable at the start and during a job. The whole-job tests (a trainer killed, a clean stop
on SIGTERM) are in tests/test_stream_jobs.py."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from paramserver.cli import main
from paramserver.data.criteo import CriteoFiles, decode_records, write_synthetic_criteo
from paramserver.errors import InvalidBatchError, StreamError
from paramserver.streams import RecordBatcher, RedisStream, RedisStreamReader, RedisWindow
from paramserver.streams.produce import produce, synthetic_lines
from tests.procs import RedisServer, free_port

BATCH = 64


def numbers(records: Sequence[bytes]) -> tuple[Any, list[str | None]]:
    """A decoder of records that are decimal numbers (anything else is bad)."""
    why = [None if r.isdigit() else f"not a number: {r!r}" for r in records]
    good = [int(r) for r, bad in zip(records, why, strict=True) if bad is None]
    return (torch.tensor(good), torch.tensor(good) * 2), why


def test_records_are_cut_into_full_batches_each_knowing_its_last_record() -> None:
    batcher = RecordBatcher(numbers, 4, max_bad_records=2, source="test")
    ids = [f"{i}-0" for i in range(10)]
    values: list[bytes | None] = [str(i).encode() for i in range(10)]
    values[5] = b"x"  # bad
    values[7] = None  # no such field
    first = batcher.add(ids[:6], values[:6])
    second = batcher.add(ids[6:], values[6:])
    batches = [batch[0].tolist() for batch, _ in first + second]
    assert batches == [[0, 1, 2, 3], [4, 6, 8, 9]]  # full batches only, across reads
    assert [position for _, position in first + second] == [
        {"id": "3-0", "records": 4, "bad_records": 0},
        {"id": "9-0", "records": 8, "bad_records": 2},
    ]
    with pytest.raises(InvalidBatchError, match=r"more than 2 bad records.*the last, 10-0"):
        batcher.add(["10-0"], [b"y"])


def test_criteo_records_decode_as_the_file_reader_parses_them(tmp_path: Path) -> None:
    path = tmp_path / "lines.txt"
    write_synthetic_criteo(path, 300, seed=3)
    lines = path.read_bytes().splitlines()
    ((dense, sparse), labels), why = decode_records(lines)
    assert why == [None] * 300
    expected = torch.cat([b[0][1] for b in CriteoFiles([path], 300).train_batches(0, 1)])
    assert torch.equal(sparse, expected) and dense.shape == (300, 13) and labels.shape == (300,)
    lines[10] = b"1\t2\tnot hex"
    lines[20] = lines[20] + b"\n" + lines[21]
    ((_, sparse_kept), _), why = decode_records(lines)
    assert why[10] == "expected 40 tab-separated fields, found 3"
    assert why[20] == "a line break inside"
    assert sum(w is not None for w in why) == 2
    assert torch.equal(sparse_kept, torch.cat([expected[:10], expected[11:20], expected[21:]]))


def write_numbers(redis_server: RedisServer, stream: str, count: int) -> RedisStream:
    source = RedisStream.from_url(
        redis_server.url(stream), batch_size=BATCH, decoder=numbers, block_ms=50
    )
    source.check()
    produce(source, iter(str(i).encode() for i in range(count)))
    return source


def take(reader: RedisStreamReader, batches: int) -> list[int]:
    return [int(x) for batch in itertools.islice(reader, batches) for x in batch[0]]


def test_a_consumer_group_hands_each_entry_to_one_trainer(redis_server: RedisServer) -> None:
    # More than one reader reads ahead (a few reads of 1024 entries), so both get some.
    source = write_numbers(redis_server, "shared", 200 * BATCH)
    first, second = source(0, 2), source(1, 2)
    seen = [take(first, 5), take(second, 5), take(first, 5), take(second, 5)]
    first.close()
    second.close()
    assert len(set(seen[0] + seen[1] + seen[2] + seen[3])) == 20 * BATCH  # none twice
    # Each reader's entries are handed to it alone: pending in its consumer, and no other.
    pending = {consumer: pending_of(source, consumer) for consumer in ("trainer-0", "trainer-1")}
    assert pending["trainer-0"] >= 10 * BATCH and pending["trainer-1"] >= 10 * BATCH
    assert sum(pending.values()) <= 200 * BATCH


def pending_of(source: RedisStream, consumer: str) -> int:
    summary = source.connect().xpending(source.stream, source.group)
    return {c["name"].decode(): c["pending"] for c in summary["consumers"]}.get(consumer, 0)


def test_a_reader_resumed_at_its_position_reads_on_without_duplicates_or_gaps(
    redis_server: RedisServer,
) -> None:
    source = write_numbers(redis_server, "resumed", 12 * BATCH)
    reader = source(0, 1)
    trained = take(reader, 3)
    position = reader.position()  # what a checkpoint would save: after 3 batches
    assert position == {"id": position["id"], "records": 3 * BATCH, "bad_records": 0}
    lost = take(reader, 2)  # trained after the checkpoint, then the trainer died
    reader.close()
    assert pending_of(source, "trainer-0") > 5 * BATCH  # handed out, read ahead, none acked
    again = source(0, 1)
    again.seek(position)
    assert pending_of(source, "trainer-0") <= 9 * BATCH  # what the checkpoint holds: acked
    rest = take(again, 9)
    assert take(again, 0) == [] and rest[: len(lost)] == lost  # the same batches again
    assert trained + rest == list(range(12 * BATCH))  # no duplicate, no gap
    again.acknowledge(again.position())
    again.close()
    assert pending_of(source, "trainer-0") == 0


def test_bad_records_in_a_stream_are_skipped_counted_and_bounded(
    redis_server: RedisServer,
) -> None:
    source = write_numbers(redis_server, "bad", 0)
    client = source.connect()
    for i in range(2 * BATCH):
        client.xadd(source.stream, {"line": b"oops" if i in (5, 70) else str(i).encode()})
    client.xadd(source.stream, {"other": b"1"})  # without the field read
    reader = source(0, 1)
    got = take(reader, 1)
    reader.close()
    assert got == [i for i in range(BATCH + 1) if i != 5]
    strict = RedisStream.from_url(  # another group: it reads the stream from its start
        redis_server.url("bad") + "?group=strict",
        batch_size=BATCH,
        decoder=numbers,
        max_bad_records=2,
    )
    strict.check()
    reader = strict(0, 1)
    with pytest.raises(InvalidBatchError, match=r"more than 2 bad records.*no such field"):
        take(reader, 2)
    reader.close()


def test_redis_unreachable_at_start_is_a_clear_error_before_any_process(
    capsys: pytest.CaptureFixture[str],
) -> None:
    port = free_port()  # nothing listens there
    url = f"redis://127.0.0.1:{port}/events"
    assert main(["train", "--dataset", f"stream:{url}", "--launcher", "processes"]) == 2
    assert f"{url}: cannot reach Redis" in capsys.readouterr().err


def test_redis_lost_during_a_job_is_retried_then_named(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    try:
        source = write_numbers(server, "lost", 3 * BATCH)
        reader = RedisStream.from_url(
            server.url("lost"), batch_size=BATCH, decoder=numbers, block_ms=50, retry_s=1.0
        )(0, 1)
        assert take(reader, 3) == list(range(3 * BATCH))
    finally:
        server.stop()
    with pytest.raises(StreamError, match=rf"{source.name}: Redis unreachable for 1 s"):
        take(reader, 1)


def test_a_stream_url_names_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="redis://HOST:PORT/STREAM"):
        RedisStream.from_url("redis://127.0.0.1:6379")
    with pytest.raises(ValueError, match=r"unknown options \['colour'\]"):
        RedisStream.from_url("redis://127.0.0.1:6379/s?colour=red")
    source = RedisStream.from_url("redis://h:7/s?group=g&field=f&start=$")
    assert (source.host, source.port, source.stream) == ("h", 7, "s")
    assert (source.group, source.record_field, source.start) == ("g", "f", "$")


def test_the_producer_writes_the_synthetic_files_lines_with_record_ids(tmp_path: Path) -> None:
    write_synthetic_criteo(tmp_path / "f", 100, seed=4)
    assert list(synthetic_lines(100, seed=4)) == (tmp_path / "f").read_bytes().splitlines()
    lines: Iterator[bytes] = synthetic_lines(3, seed=4, record_ids=True, first_id=254)
    assert [line.rsplit(b"\t", 1)[1] for line in lines] == [b"fe", b"ff", b"100"]


def test_a_held_out_window_is_the_newest_records_of_a_separate_stream(
    redis_server: RedisServer,
) -> None:
    source = write_numbers(redis_server, "held-out", 10 * BATCH)
    source.connect().xadd(source.stream, {"line": b"bad"})
    window = RedisWindow(source, records=3 * BATCH + 1)
    newest = torch.cat([batch[0] for batch in window()])
    assert newest.tolist() == list(range(7 * BATCH, 10 * BATCH))  # the bad one left out
    source.connect().xadd(source.stream, {"line": str(10 * BATCH).encode()})
    assert torch.cat([batch[0] for batch in window()])[-1] == 10 * BATCH  # it moves on
