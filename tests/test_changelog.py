"""The change log's files (paramserver.changelog): segments round-trip with each codec, any
damage is refused naming the file, and a follower hands on a server's chain only in order."""

from __future__ import annotations

import io
import itertools
import json
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import paramserver.changelog.log as log_module
import paramserver.changelog.publisher as publisher_module
from paramserver.changelog.collect import ChangeCollector, attach_collector, cut
from paramserver.changelog.log import (
    MANIFEST,
    WRITER_LOCK,
    ChainFollower,
    LogWriter,
    read_manifest,
    server_dir,
)
from paramserver.changelog.publisher import Publisher
from paramserver.changelog.segment import Segment, TableChanges, read_segment, write_segment
from paramserver.errors import ChangeLogError
from paramserver.store.snapshot import restore_store, snapshot_store
from paramserver.store.store import Store
from paramserver.store.table import Reading
from paramserver.wire.compression import error_bound
from tests.helpers import ids, make_store, train_read


def segment(first_step: int = 1, rows: int = 5, dim: int = 4, seed: int = 0) -> Segment:
    generator = torch.Generator().manual_seed(seed)
    made = Segment("job", 0, 1, 0, first_step, first_step + 9, first_step - 1, first_step + 9)
    ids = torch.randperm(1000, generator=generator)[: rows + 2]
    values = torch.randn(rows, dim, generator=generator)
    made.tables["t"] = TableChanges(ids[:rows], values, ids[rows:])
    made.tables["quiet"] = TableChanges(
        torch.zeros(0, dtype=torch.int64), torch.zeros(0, 8), torch.zeros(0, dtype=torch.int64)
    )
    made.dense["conv.weight"] = torch.randn(2, 3, 2, 2, generator=generator)
    return made


def write(path: Path, made: Segment, codec: str = "none") -> bytes:
    buffer = io.BytesIO()
    write_segment(buffer, made, codec)
    path.write_bytes(buffer.getvalue())
    return buffer.getvalue()


@pytest.mark.parametrize("codec", ["none", "bf16", "int8"])
def test_a_segment_round_trips_within_its_codecs_bound(tmp_path: Path, codec: str) -> None:
    made = segment()
    write(tmp_path / "s", made, codec)
    read = read_segment(tmp_path / "s")
    assert (read.writer, read.server, read.sequence, read.previous) == ("job", 0, 1, 0)
    assert (read.first_step, read.last_step, read.after_changes, read.changes) == (1, 10, 0, 10)
    written, got = made.tables["t"], read.tables["t"]
    assert torch.equal(got.ids, written.ids) and torch.equal(got.removed, written.removed)
    error = (got.values - written.values).abs()
    assert bool((error <= error_bound(codec, written.values)).all())
    assert (codec == "none") == bool((error == 0).all())
    assert read.tables["quiet"].values.shape == (0, 8)
    assert torch.equal(read.dense["conv.weight"], made.dense["conv.weight"])  # always exact


@pytest.mark.parametrize(("codec", "value_bytes"), [("none", 4 * 32), ("int8", 32 + 4)])
def test_a_segment_costs_an_id_and_the_rows_value_bytes_per_row(
    tmp_path: Path, codec: str, value_bytes: int
) -> None:
    def size(rows: int) -> int:
        made = Segment("job", 0, 1, 0, 1, 1, 0, 1)
        ids = torch.arange(rows, dtype=torch.int64)
        made.tables["t"] = TableChanges(ids, torch.randn(rows, 32), ids[:0])
        return len(write(tmp_path / "s", made, codec))

    per_row = (size(20_000) - size(10_000)) / 10_000
    assert per_row < 8 + value_bytes + 0.001  # (the header's byte offsets grow a digit)


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[:-7],  # truncated
        lambda data: data[:200] + bytes([data[200] ^ 1]) + data[201:],  # one bit flipped
        lambda data: b"NOTALOG!" + data[8:],
        lambda data: b"",
    ],
    ids=["truncated", "bit flipped", "bad magic", "empty"],
)
def test_a_damaged_segment_is_refused_naming_its_file(tmp_path: Path, damage) -> None:
    data = write(tmp_path / "s", segment())
    (tmp_path / "bad").write_bytes(damage(data))
    with pytest.raises(ChangeLogError, match=str(tmp_path / "bad")):
        read_segment(tmp_path / "bad")


def test_a_segment_naming_an_id_twice_is_refused(tmp_path: Path) -> None:
    made = segment()
    t = made.tables["t"]
    made.tables["t"] = TableChanges(t.ids, t.values, t.ids[:1])  # written and removed
    write(tmp_path / "s", made)
    with pytest.raises(ChangeLogError, match="more than once"):
        read_segment(tmp_path / "s")


def published(root: Path, count: int, keep: int = 100) -> LogWriter:
    """A chain of ``count`` segments, its writer closed (another may take the chain on)."""
    writer = LogWriter(root, "job", server=0, keep=keep)
    for i in range(count):
        writer.append(segment(first_step=10 * i + 1, seed=i))
    writer.close()
    return writer


def test_a_follower_hands_on_the_chain_in_order_and_only_what_is_new(tmp_path: Path) -> None:
    published(tmp_path, 3)
    follower = ChainFollower(tmp_path, 0)
    found, error = follower.pending()
    assert error is None
    assert [(s.sequence, s.previous, s.first_step) for s in found] == [
        (1, 0, 1),
        (2, 1, 11),
        (3, 2, 21),
    ]
    assert follower.pending()[0][0].sequence == 1  # nothing counts as applied until said
    follower.applied_up_to(found[1])
    LogWriter(tmp_path, "resumed", server=0).append(segment(first_step=31))  # numbers on
    assert [s.sequence for s in follower.pending()[0]] == [3, 4]
    assert read_manifest(server_dir(tmp_path, 0)).writer == "resumed"


def test_a_manifest_keeps_the_newest_segments_and_a_follower_behind_them_is_told(
    tmp_path: Path,
) -> None:
    published(tmp_path, 5, keep=2)
    directory = server_dir(tmp_path, 0)
    assert sorted(p.name for p in directory.iterdir()) == [
        WRITER_LOCK,
        MANIFEST,
        "segment-000000000004.pslog",
        "segment-000000000005.pslog",
    ]
    found, error = ChainFollower(tmp_path, 0, changes=10).pending()  # segment 1 applied
    assert found == [] and error is not None and "no longer reaches back" in str(error)
    assert [s.sequence for s in ChainFollower(tmp_path, 0, changes=30).pending()[0]] == [4, 5]


def test_a_manifest_keeps_every_segment_since_the_newest_checkpoint(tmp_path: Path) -> None:
    writer = LogWriter(tmp_path, "job", server=0, keep=2)
    writer.keep_after = 15  # a checkpoint covers the store up to change 15
    for i in range(5):
        writer.append(segment(first_step=10 * i + 1, seed=i))  # changes (0, 10], (10, 20]...
    assert [entry.sequence for entry in writer.segments] == [2, 3, 4, 5]
    found, error = ChainFollower(tmp_path, 0, changes=15).pending()  # from the checkpoint
    assert error is None and [s.sequence for s in found] == [2, 3, 4, 5]


def edit_manifest(root: Path, edit) -> None:
    path = server_dir(root, 0) / MANIFEST
    document = json.loads(path.read_text())
    document["segments"] = edit(document["segments"])
    path.write_text(json.dumps(document))


@pytest.mark.parametrize(
    ("edit", "good"),
    [
        (lambda s: [s[0], s[2], s[3]], 1),  # a gap
        (lambda s: [s[0], s[1], s[1], s[2]], 2),  # a duplicate
        (lambda s: [s[0], s[2], s[1], s[3]], 1),  # out of order
    ],
    ids=["gap", "duplicate", "out of order"],
)
def test_a_broken_chain_hands_on_what_comes_before_the_break_and_names_the_file(
    tmp_path: Path,
    edit,
    good: int,
) -> None:
    published(tmp_path, 4)
    edit_manifest(tmp_path, edit)
    found, error = ChainFollower(tmp_path, 0).pending()
    assert [s.sequence for s in found] == list(range(1, good + 1))
    assert error is not None and "segment-0000000000" in str(error)


def test_a_segment_whose_header_disagrees_with_its_entry_is_refused(tmp_path: Path) -> None:
    published(tmp_path, 3)
    directory = server_dir(tmp_path, 0)
    (directory / "segment-000000000003.pslog").write_bytes(
        (directory / "segment-000000000002.pslog").read_bytes()
    )
    found, error = ChainFollower(tmp_path, 0).pending()
    assert [s.sequence for s in found] == [1, 2]
    assert error is not None and "disagrees with its manifest entry" in str(error)


def test_a_damaged_manifest_is_refused_naming_it(tmp_path: Path) -> None:
    published(tmp_path, 1)
    (server_dir(tmp_path, 0) / MANIFEST).write_text('{"format": 1, "writer": 3}')
    found, error = ChainFollower(tmp_path, 0).pending()
    assert found == [] and error is not None and MANIFEST in str(error)


def test_a_cut_publishes_each_ids_last_change_with_the_rows_current_value() -> None:
    store = make_store()
    collector = attach_collector(store)
    train_read(store, 1, hashed=ids(5, 7))
    train_read(store, 2, hashed=ids(5, 7))  # both admitted
    store.apply_rows({"fixed": (ids(2, 9), torch.ones(2, 4))}, {"fixed": 0.5}, clock=2)
    store.apply_dense({"w": torch.ones(3)}, lr=0.5)
    store.delete_ids("hashed", ids(7))  # written, then removed: a tombstone
    made = cut(store, collector, first_step=1, last_step=2)
    assert made.changes == store.changes.sequence and made.server == 0
    assert made.tables["fixed"].ids.tolist() == [2, 9]
    assert made.tables["hashed"].ids.tolist() == [5]
    assert made.tables["hashed"].removed.tolist() == [7]
    now = store.read({"fixed": ids(2, 9), "hashed": ids(5)}, Reading()).values
    assert torch.equal(made.tables["fixed"].values, now["fixed"])
    assert torch.equal(made.tables["hashed"].values, now["hashed"])
    assert torch.equal(made.dense["w"], store.read_dense(["w"]).values["w"])
    again = cut(store, collector, first_step=3, last_step=3)  # nothing since
    assert again.tables == {} and again.dense == {} and again.changes == made.changes


def test_an_id_removed_then_made_again_is_published_as_a_row() -> None:
    store = make_store()
    train_read(store, 1, hashed=ids(5))
    train_read(store, 2, hashed=ids(5))
    collector = attach_collector(store)
    store.delete_ids("hashed", ids(5))
    train_read(store, 3, hashed=ids(5))
    train_read(store, 4, hashed=ids(5))  # admitted again
    made = cut(store, collector, first_step=3, last_step=4)
    assert made.tables["hashed"].ids.tolist() == [5] and made.tables["hashed"].removed.numel() == 0


def replay(root: Path, server: int = 0) -> dict[str, dict[int, list[float]]]:
    """Every row and dense value the chain under ``root`` ends with, applied in order."""
    state: dict[str, dict[int, list[float]]] = {}
    found, error = ChainFollower(root, server).pending()
    assert error is None
    for made in found:
        for name, changes in made.tables.items():
            rows = state.setdefault(name, {})
            rows.update(zip(changes.ids.tolist(), changes.values.tolist(), strict=True))
            for gone in changes.removed.tolist():
                rows.pop(gone, None)
        for name, value in made.dense.items():
            state[name] = {0: value.flatten().tolist()}
    return state


def test_a_timed_publisher_chain_replays_to_the_stores_state(tmp_path: Path) -> None:
    store = make_store()
    publisher = Publisher(store, tmp_path, "job", every_s=0.02)
    generator = torch.Generator().manual_seed(0)
    for clock in range(1, 40):
        store.advance_clock(clock)
        hashed = torch.randint(0, 12, (4,), generator=generator).unique()
        train_read(store, clock, hashed=hashed)  # admits, and expires what sat 3 steps
        fixed = torch.randint(0, 20, (3,), generator=generator).unique()
        store.apply_rows({"fixed": (fixed, torch.ones(fixed.numel(), 4))}, {"fixed": 0.1}, clock)
        store.apply_dense({"w": torch.ones(3)}, lr=0.1)
        time.sleep(0.003)
    publisher.close()
    assert publisher.stats.segments >= 3 and publisher.stats.failures == 0
    state = replay(tmp_path)
    held = store.export_state()
    hashed_rows = dict(
        zip(held["hashed"]["ids"].tolist(), held["hashed"]["value"].tolist(), strict=True)
    )
    assert state["hashed"] == hashed_rows and publisher.stats.removed > 0
    changed = {row: value for row, value in enumerate(held["fixed"]["value"].tolist())}
    assert all(changed[row] == value for row, value in state["fixed"].items())
    assert state["w"] == {0: held["w"]["value"].tolist()}
    steps = [(s.first_step, s.last_step) for s in ChainFollower(tmp_path, 0).pending()[0]]
    assert steps[0][0] == 1 and steps[-1][1] == 39
    assert all(b[0] == a[1] + 1 for a, b in itertools.pairwise(steps))


def test_a_segment_that_cannot_be_written_is_tried_again_and_the_chain_skips_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the disk is full no further segment is cut; the first cut after it is freed
    covers every step since."""
    store = make_store()
    publisher = Publisher(store, tmp_path, "job", every_s=0.01, timed=False)
    append, disk_freed = publisher.writer.append, threading.Event()

    def full_disk(segment: Segment, codec: str = "none") -> object:
        if not disk_freed.is_set():
            raise OSError(28, "No space left on device")
        return append(segment, codec)

    def step(clock: int) -> None:
        store.advance_clock(clock)
        store.apply_rows({"fixed": (ids(clock), torch.ones(1, 4))}, {"fixed": 0.1}, clock)
        publisher.cut()

    monkeypatch.setattr(publisher.writer, "append", full_disk)
    step(1)
    deadline = time.monotonic() + 10
    while publisher.stats.failures < 3 and time.monotonic() < deadline:
        time.sleep(0.005)  # tried again and again
    step(2)
    step(3)
    assert len(publisher._waiting) == 1  # steps 2 and 3 wait in the collector, not cut
    disk_freed.set()
    assert publisher.flush(10.0)
    step(4)
    publisher.close()
    found = ChainFollower(tmp_path, 0).pending()[0]
    assert [(s.sequence, s.first_step, s.last_step) for s in found][:2] == [(1, 1, 1), (2, 2, 4)]
    assert [s.tables["fixed"].ids.tolist() for s in found[:2]] == [[1], [2, 3, 4]]
    assert publisher.stats.failures >= 3 and len(found) == 3  # and the closing cut


def test_a_timed_publisher_cuts_nothing_while_nothing_changes(tmp_path: Path) -> None:
    store = make_store()
    publisher = Publisher(store, tmp_path, "job", every_s=0.01)
    time.sleep(0.2)  # many periods, no change
    assert publisher.stats.segments == 0
    store.advance_clock(1)
    store.apply_rows({"fixed": (ids(1), torch.ones(1, 4))}, {"fixed": 0.1}, 1)
    deadline = time.monotonic() + 10
    while publisher.stats.segments == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    publisher.close()
    found = ChainFollower(tmp_path, 0).pending()[0]
    assert [s.tables["fixed"].ids.tolist() for s in found[:1]] == [[1]]


def test_after_a_cut_that_failed_the_next_segment_is_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cut that raised had taken its changes: the next segment holds every row, so serving
    loses none of them."""
    store = make_store()
    failed = []

    def failing_once(store: Store, collector: ChangeCollector, first: int, last: int) -> Segment:
        if not failed:
            failed.append(collector.take())  # what it held is gone with it
            raise RuntimeError("a bug")
        return cut(store, collector, first, last)

    monkeypatch.setattr(publisher_module, "cut", failing_once)
    publisher = Publisher(store, tmp_path, "job", every_s=0.01)
    for clock in (1, 2):
        store.advance_clock(clock)
        store.apply_rows({"fixed": (ids(clock), torch.ones(1, 4))}, {"fixed": 0.1}, clock)
        deadline = time.monotonic() + 10
        while (publisher.stats.failures + publisher.stats.segments) < clock and (
            time.monotonic() < deadline
        ):
            time.sleep(0.005)
    publisher.close()
    assert failed and publisher.stats.failures == 1
    found = ChainFollower(tmp_path, 0).pending()[0]
    assert found[0].full and set(found[0].tables["fixed"].ids.tolist()) >= {1, 2}


def test_a_collector_left_uncut_keeps_one_entry_per_changed_id(tmp_path: Path) -> None:
    collector = ChangeCollector(compact_at=100)
    for sequence in range(1, 1001):  # ids 0..9 written and removed again and again
        collector.rows_written("t", torch.tensor([sequence % 10]), sequence)
        if sequence % 7 == 0:
            collector.ids_removed("t", torch.tensor([sequence % 10]), sequence)
    assert sum(ids.numel() for ids, _ in collector._events["t"]) <= 110
    changed = collector.take()
    last_sequence = {k: max(s for s in range(1, 1001) if s % 10 == k) for k in range(10)}
    last_removed = {k for k, s in last_sequence.items() if s % 7 == 0}
    assert set(changed.removed["t"].tolist()) == last_removed
    assert set(changed.written["t"].tolist()) == set(range(10)) - last_removed
    assert (changed.after_changes, changed.changes) == (0, 1000)


def test_a_follower_from_a_base_starts_at_the_segment_that_holds_the_bases_change(
    tmp_path: Path,
) -> None:
    published(tmp_path, 3)  # changes (0, 10], (10, 20], (20, 30]
    assert [s.sequence for s in ChainFollower(tmp_path, 0, changes=15).pending()[0]] == [2, 3]
    assert ChainFollower(tmp_path, 0, changes=30).pending() == ([], None)  # the base is newest


def test_a_segment_that_does_not_start_where_the_chain_ends_is_refused(tmp_path: Path) -> None:
    published(tmp_path, 2)  # changes (0, 10], (10, 20]
    LogWriter(tmp_path, "other", server=0).append(segment(first_step=6))  # (5, 15], not full
    found, error = ChainFollower(tmp_path, 0).pending()
    assert [s.sequence for s in found] == [1, 2]
    assert error is not None and "starts after change 5" in str(error)
    assert "segment-000000000003.pslog" in str(error)


def test_a_chain_takes_one_writer_at_a_time(tmp_path: Path) -> None:
    first = LogWriter(tmp_path, "host-a:11", server=0)
    with pytest.raises(ChangeLogError, match=r"another process writes this chain \(host-a:11\)"):
        LogWriter(tmp_path, "host-b:22", server=0)
    LogWriter(tmp_path, "host-b:22", server=1).close()  # another server's chain is free
    first.close()
    LogWriter(tmp_path, "host-b:22", server=0).close()  # free once its writer let go


def resumed_store(saved: tuple) -> Store:
    """A store as a resumed server builds it: fresh, then restored from ``saved``."""
    store = make_store()
    restore_store(store, [saved])
    return store


def test_a_job_resumed_from_an_earlier_checkpoint_publishes_a_full_segment_first(
    tmp_path: Path,
) -> None:
    store = make_store()
    publisher = Publisher(store, tmp_path, "job", every_s=60.0, timed=False)
    for clock in (1, 2):
        store.advance_clock(clock)
        train_read(store, clock, hashed=ids(5, 6))  # admitted at the second sighting
        store.apply_rows({"fixed": (ids(clock), torch.ones(1, 4))}, {"fixed": 0.5}, clock)
        if clock == 1:
            checkpoint = snapshot_store(store)  # taken before step 2's changes
        publisher.cut(clock)
    publisher.close()
    ended_at = publisher.writer.last_changes
    follower = ChainFollower(tmp_path, 0)
    follower.applied_up_to(follower.pending()[0][-1])  # serving has the whole first run

    resumed = resumed_store(checkpoint)  # back at step 1: step 2's changes are gone
    assert resumed.changes.covered() < ended_at
    again = Publisher(resumed, tmp_path, "job-resumed", every_s=60.0, timed=False)
    resumed.apply_rows({"fixed": (ids(7), torch.ones(1, 4))}, {"fixed": 0.5}, 2)
    again.close()
    found, error = follower.pending()
    assert error is None and [s.full for s in found] == [True, False]
    full = found[0]
    assert full.after_changes == 0 and full.changes == ended_at  # numbered on, never back
    assert found[1].after_changes == ended_at and found[1].tables["fixed"].ids.tolist() == [7]
    held = resumed.export_state()
    assert full.tables["fixed"].ids.tolist() == list(range(20))
    assert full.tables["hashed"].ids.tolist() == held["hashed"]["ids"].tolist() == []
    assert torch.equal(found[1].tables["fixed"].values, held["fixed"]["value"][7:8])
    # A follower from the job's start replays to the resumed store's state too.
    assert replay(tmp_path)["fixed"] == dict(enumerate(held["fixed"]["value"].tolist()))


def test_a_job_resumed_where_its_log_ends_numbers_on_without_a_full_segment(
    tmp_path: Path,
) -> None:
    store = make_store()
    publisher = Publisher(store, tmp_path, "job", every_s=60.0, timed=False)
    store.apply_rows({"fixed": (ids(3), torch.ones(1, 4))}, {"fixed": 0.5}, 1)
    publisher.close()
    again = Publisher(resumed_store(snapshot_store(store)), tmp_path, "job", every_s=60.0)
    again.close()
    found = ChainFollower(tmp_path, 0).pending()[0]
    assert [s.full for s in found] == [False, False] and found[1].after_changes == found[0].changes


@pytest.fixture
def threads_switching_often():
    """Threads switch between any two steps of a cut (the interpreter's default: 5 ms)."""
    default = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(default)


@pytest.mark.usefixtures("threads_switching_often")
def test_segments_cut_from_many_threads_at_once_queue_in_their_order(tmp_path: Path) -> None:
    store = make_store()
    publisher = Publisher(store, tmp_path, "job", every_s=0.001)  # its timer cuts too
    stop = threading.Event()

    def cutting() -> None:
        while not stop.is_set():
            publisher.cut()
            time.sleep(0.002)

    threads = [threading.Thread(target=cutting) for _ in range(3)]
    for thread in threads:
        thread.start()
    for clock in range(1, 200):
        store.advance_clock(clock)
        store.apply_rows({"fixed": (ids(clock % 20), torch.ones(1, 4))}, {"fixed": 0.1}, clock)
        time.sleep(0.001)
    stop.set()
    for thread in threads:
        thread.join()
    publisher.close()
    found, error = ChainFollower(tmp_path, 0, most=10**6).pending()
    assert error is None and len(found) > 10
    assert found[-1].changes == store.changes.sequence


def test_a_manifest_that_could_not_be_written_leaves_the_chain_to_number_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = published(tmp_path, 1)
    real, failed = log_module.write_atomic, []

    def manifest_fails_once(path: Path, write, **kwargs):
        if path.name == MANIFEST and not failed:
            failed.append(path)
            raise OSError(28, "No space left on device")
        return real(path, write, **kwargs)

    monkeypatch.setattr(log_module, "write_atomic", manifest_fails_once)
    with pytest.raises(OSError):
        writer.append(segment(first_step=11, seed=1))
    writer.append(segment(first_step=11, seed=1))  # the publisher's retry
    found, error = ChainFollower(tmp_path, 0).pending()
    assert error is None and [s.sequence for s in found] == [1, 2]
