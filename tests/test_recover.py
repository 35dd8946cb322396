"""A training server's store rebuilt from its last checkpoint and its change log since
(paramserver.changelog.recover): bitwise the store it was at its last cut, its dynamic
table's admissions, expiries and evictions included; from a full segment alone; and a
recovery section that does not hold together is refused naming the file."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import paramserver as ps
from paramserver.changelog.collect import attach_collector, cut
from paramserver.changelog.log import ChainFollower
from paramserver.changelog.publisher import Publisher
from paramserver.changelog.recover import recover_store, replay
from paramserver.changelog.segment import Segment, read_segment, write_segment
from paramserver.checkpoint import open_checkpoint
from paramserver.embedding import DynamicOptions
from paramserver.errors import ChangeLogError
from paramserver.futures import completed
from paramserver.launch import roles
from paramserver.optimconfig import OptimizerConfig
from paramserver.server.gate import CallGate
from paramserver.sharding import DenseSpec, ShardPlan, TableSpec
from paramserver.store.snapshot import restore_store, snapshot_store
from paramserver.store.store import Store
from paramserver.store.table import Reading
from paramserver.tableinit import RowInit
from paramserver.trainer.client import PSClient
from paramserver.transport.base import Transport
from paramserver.wire.messages import PushPullReply, PushPullRequest
from tests.helpers import HashedModel, TinyRecModel, hashed_batches, mse, threads_job, tiny_batches

DYNAMIC = DynamicOptions(min_count=2, ttl_steps=4, capacity=14)


def make_store() -> Store:
    """Adam (state and step counts), versions (a cache lag), a fixed table and a dynamic one
    that admits at the second sighting, expires after 4 steps and holds at most 14 rows."""
    tables = [
        TableSpec("fixed", 30, 4, torch.float32),
        TableSpec("hashed", 0, 4, torch.float32, dynamic=DYNAMIC),
    ]
    plan = ShardPlan([DenseSpec("w", (3,), torch.float32)], tables, num_servers=1)
    rule = OptimizerConfig(name="adam", lr=0.05)
    inits = {"fixed": RowInit.given("fixed", torch.arange(120.0).view(30, 4))}
    return Store(
        0, plan, {"w": torch.ones(3)}, inits, rule, {"fixed": rule, "hashed": rule}, cache_lag=2
    )


def train_step(store: Store, clock: int, generator: torch.Generator) -> None:
    """One step: a training read of random ids of both tables (admitting, touching, expiring
    and evicting), an update of some of the rows read (the others only touched), and one of
    the dense value."""
    store.advance_clock(clock)
    hashed = torch.randint(0, 40, (8,), generator=generator).unique()
    fixed = torch.randint(0, 30, (6,), generator=generator).unique()
    store.read({"hashed": hashed, "fixed": fixed}, Reading(train=True, clock=clock))
    grads = {
        name: (ids[::2], torch.randn(ids[::2].numel(), 4, generator=generator))
        for name, ids in (("hashed", hashed), ("fixed", fixed))
    }
    store.apply_rows(grads, {"hashed": 0.05, "fixed": 0.05}, clock)
    store.apply_dense({"w": torch.randn(3, generator=generator)}, 0.05)


def canonical(store: Store) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The store's snapshot with each table's rows and pending ids sorted by id (a rebuilt
    dynamic table holds them at other places), less the change count (a rebuilt store numbers
    its own changes)."""
    tensors, meta = snapshot_store(store)
    out = dict(tensors)
    for name in store.tables:
        for prefix in ("", "pending."):
            key = f"table/{name}/{prefix}ids"
            if key not in tensors:
                continue
            order = torch.argsort(tensors[key])
            for role, tensor in tensors.items():
                parts = role.split("/")
                if parts[1] == name and parts[2].startswith(prefix) and (
                    prefix or not parts[2].startswith("pending.")
                ):  # fmt: skip
                    out[role] = tensor[order]
    return out, {k: v for k, v in meta.items() if k != "sequence"}


def assert_same(a: Store, b: Store) -> None:
    (tensors_a, meta_a), (tensors_b, meta_b) = canonical(a), canonical(b)
    assert tensors_a.keys() == tensors_b.keys()
    for key, tensor in tensors_a.items():
        assert torch.equal(tensor, tensors_b[key]), key
    assert meta_a == meta_b


def test_a_store_rebuilt_from_its_checkpoint_and_log_is_the_one_it_was(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(3)
    store = make_store()
    publisher = Publisher(store, tmp_path, "job", every_s=3600, timed=False, recovers=True)
    checkpoint = None
    for clock in range(1, 25):
        train_step(store, clock, generator)
        if clock == 9:  # between two cuts: the segment that holds its change is replayed too
            checkpoint = snapshot_store(store)
        if clock % 2 == 0:
            publisher.cut(clock)
    publisher.close()
    assert checkpoint is not None
    counters = store.table_stats()["hashed"]
    assert counters["evicted"] > 0 and counters["pending_ids"] > 0  # every rule acted
    segments, error = ChainFollower(tmp_path, 0, checkpoint[1]["sequence"], most=10**6).pending()
    assert error is None and len(segments) == 9  # cut at clocks 10 to 24, and closing
    rebuilt = make_store()
    recover_store(rebuilt, [checkpoint], segments)
    assert_same(store, rebuilt)
    # What the segments hold for serving is what it was: the values of the rows written.
    last = segments[-2].tables["fixed"]
    assert torch.equal(last.values, store.read({"fixed": last.ids}, Reading()).values["fixed"])


def test_a_store_is_rebuilt_from_a_full_segment_without_its_checkpoint(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(5)
    first = make_store()
    for clock in range(1, 8):
        train_step(first, clock, generator)
    saved = snapshot_store(first)
    resumed = make_store()  # a job resumed from that checkpoint onto a log it never wrote
    restore_store(resumed, [saved])
    publisher = Publisher(resumed, tmp_path, "job", every_s=3600, timed=False, recovers=True)
    for clock in range(8, 12):
        train_step(resumed, clock, generator)
        publisher.cut(clock)
    publisher.close()
    segments, error = ChainFollower(tmp_path, 0, most=10**6).pending()
    assert error is None and segments[0].full and segments[0].recovery is not None
    rebuilt = make_store()
    recover_store(rebuilt, [], segments)  # no checkpoint: the full segment holds the store
    assert_same(resumed, rebuilt)


def test_a_segment_published_for_serving_only_cannot_be_replayed(tmp_path: Path) -> None:
    store = make_store()
    publisher = Publisher(store, tmp_path, "job", every_s=3600, timed=False)
    train_step(store, 1, torch.Generator().manual_seed(0))
    publisher.close()
    segment = ChainFollower(tmp_path, 0).pending()[0][0]
    with pytest.raises(ChangeLogError, match="holds no recovery section"):
        replay(make_store(), segment)


def recovery_segment() -> Segment:
    """A segment of two steps, with its recovery section."""
    store = make_store()
    collector = attach_collector(store, recovers=True)
    train_step(store, 1, torch.Generator().manual_seed(1))
    train_step(store, 2, torch.Generator().manual_seed(2))
    segment = cut(store, collector, 1, 2)
    segment.sequence = 1
    return segment


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda r: r.tables["fixed"].update(steps=r.tables["fixed"]["steps"][1:]),
         "steps has not one entry per id of ids"),
        (lambda r: r.tables["hashed"].update(ids=torch.zeros_like(r.tables["hashed"]["ids"])),
         "ids must be unique"),
        (lambda r: r.meta["hashed"]["counters"].update(evicted="many"), "bad metadata"),
        (lambda r: r.dense["w"].pop("version"), "lacks its value or version"),
    ],
    ids=["a short per-row tensor", "repeated ids", "bad counters", "no version"],
)  # fmt: skip
def test_a_recovery_section_that_does_not_hold_together_is_refused(
    tmp_path: Path, damage: Any, message: str
) -> None:
    segment = recovery_segment()
    assert segment.recovery is not None
    damage(segment.recovery)
    path = tmp_path / "segment.pslog"
    with path.open("wb") as f:
        write_segment(f, segment)
    with pytest.raises(ChangeLogError, match=f"{path}: .*{message}"):
        read_segment(path)


class Admitting(HashedModel):
    """Ids admitted at their second sighting, expired 3 steps untouched."""

    def __init__(self) -> None:
        super().__init__(dynamic=True)
        self.emb = ps.DynamicEmbedding(4, mode="mean", init_scale=0.1, min_count=2, ttl_steps=3)


@pytest.mark.parametrize(
    ("model_fn", "batches"), [(TinyRecModel, tiny_batches), (Admitting, hashed_batches)]
)
def test_a_sync_jobs_servers_are_rebuilt_with_their_books_from_a_checkpoint_and_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_fn: Any, batches: Any
) -> None:
    """Each server of a sync job that published with recovery sections, rebuilt from a
    checkpoint taken during the job and its log since: its store as the job ended it,
    bitwise, and its books (each trainer's newest call, who left) as its own."""
    publisher_of = roles.publisher_of

    def recovering_publisher(shard: Any, settings: Any, mode: Any, **options: Any) -> Any:
        return publisher_of(shard, dataclasses.replace(settings, recover=True), mode, **options)

    monkeypatch.setattr(roles, "publisher_of", recovering_publisher)
    config = ps.TrainConfig(
        servers=2, trainers=2, mode="sync", optimizer="adam", lr=0.01, launcher="threads",
        progress=False, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=5,
        checkpoint_keep=3, publish_dir=str(tmp_path / "log"), publish_every=0.001,
    )  # fmt: skip
    _, transport = threads_job(config, model_fn, lambda t, n: batches(t, num_batches=20), mse)
    found = open_checkpoint(tmp_path / "ckpt" / "ckpt-0000000015")  # 20 is the final one
    bare = config.replace(publish_dir=None, checkpoint_dir=None, checkpoint_every=None)
    for server, endpoint in enumerate(transport.endpoints):
        saved = found.read_part(f"server-{server}")
        chain = ChainFollower(tmp_path / "log", server, saved[1]["sequence"], most=10**6)
        segments, error = chain.pending()
        assert error is None and segments and segments[-1].recovery is not None
        rebuilt = roles.build_server(server, bare, model_fn)
        try:
            recover_store(rebuilt.shard.store, [saved], segments)
            rebuilt.coordinator.recover_books(segments[-1].recovery.books)
            assert_same(endpoint.shard.store, rebuilt.shard.store)
            books = rebuilt.coordinator.recovery_books()
            assert books == endpoint.coordinator.recovery_books() and books["left"] == [0, 1]
        finally:
            rebuilt.coordinator.close()


def test_a_trainers_calls_are_released_once_a_second_written_segment_covers_them(
    tmp_path: Path,
) -> None:
    """What a recovering publisher tells trainers they may let go of: each one's newest call
    that two written segments cover, so a damaged newest segment loses none of them."""
    store = make_store()
    books = {"calls": {"0": 3, "1": 2}, "left": [], "departed": {}}
    publisher = Publisher(
        store, tmp_path, "job", every_s=60, timed=False, recovers=True, books=lambda: books
    )
    try:
        generator = torch.Generator().manual_seed(0)
        assert publisher.released_through(0) == -1
        train_step(store, 1, generator)
        publisher.cut()
        assert publisher.flush(10) and publisher.released_through(0) == -1
        books = {"calls": {"0": 7, "1": 6}, "left": [], "departed": {}}
        train_step(store, 2, generator)
        publisher.cut()
        assert publisher.flush(10)
        assert (publisher.released_through(0), publisher.released_through(1)) == (3, 2)
        assert publisher.released_through(5) == -1  # a trainer the books never held
    finally:
        publisher.close()


def test_a_cut_waits_for_the_calls_in_flight_and_holds_new_ones_back() -> None:
    """The gate's promise: no call is between its admission and its read while a cut runs."""
    gate = CallGate()
    events: list[str] = []
    in_call, cut_started = threading.Event(), threading.Event()

    def call(name: str, hold: threading.Event | None = None) -> None:
        with gate.call():
            events.append(f"{name} in")
            if hold is not None:
                in_call.set()
                hold.wait(5)
            events.append(f"{name} out")

    def cutter() -> None:
        with gate.cut():
            cut_started.set()
            events.append("cut")
            time.sleep(0.1)  # a call arriving now waits
            events.append("cut done")

    release = threading.Event()
    first = threading.Thread(target=call, args=("first", release))
    first.start()
    assert in_call.wait(5)
    cutting = threading.Thread(target=cutter)
    cutting.start()
    time.sleep(0.1)
    assert "cut" not in events  # the first call is still in flight
    release.set()
    assert cut_started.wait(5)
    second = threading.Thread(target=call, args=("second",))
    second.start()
    for thread in (first, cutting, second):
        thread.join(5)
    assert events == ["first in", "first out", "cut", "cut done", "second in", "second out"]


class Recording(Transport):
    """Answers every call at once (keeping no log: ``durable_through`` None) and records the
    calls each server was sent; ``restarts`` is the RPC world it is in."""

    num_servers = 2

    def __init__(self) -> None:
        self.sent: list[tuple[int, str, list[int]]] = []
        self.restarts = 0

    def world(self) -> int:
        return self.restarts

    def call(self, server: int, op: str, *args: Any, timeout_s: float | None = None) -> Any:
        message = args[0]
        calls = [r.call for r in message] if isinstance(message, list) else [message.call]
        self.sent.append((server, op, calls))
        return completed(PushPullReply())


TWO_SERVER_PLAN = ShardPlan([DenseSpec("w", (3,), torch.float32)], [], num_servers=2)


def test_a_trainer_keeps_the_calls_a_servers_log_does_not_hold_and_sends_them_in_order() -> None:
    """Kept calls are let go of as the log covers them, all of them where a server keeps no
    log; sent again, each server gets its own in order, several to a message."""
    transport = Recording()
    client = PSClient(transport, TWO_SERVER_PLAN, trainer=0)
    for call in range(80):
        client.kept.sent([[PushPullRequest(0, call)], [PushPullRequest(0, call)]])
    client.kept.release(0, 9)
    client.kept.release(1, None)
    assert client.kept.calls(0) == list(range(10, 80))
    assert client.kept.calls(1) == []
    client.kept.sent([[], [PushPullRequest(0, 78), PushPullRequest(0, 79)]])
    futures = client.send_again()
    assert all(f.wait()[0] is not None for f in futures)
    assert transport.sent == [
        (0, "push_pulls", list(range(10, 74))),
        (0, "push_pulls", list(range(74, 80))),
        (1, "push_pulls", [78, 79]),
    ]
    assert client.kept.resent == 72


def test_the_first_call_into_a_new_world_follows_the_calls_kept_for_it() -> None:
    """A restart noticed away from the data calls (the chief's checkpoint, say, while its
    last call had been answered): the next call is sent after every call the restarted
    server's log may lack, in order, never alone (the server would refuse it as a gap)."""
    transport = Recording()
    client = PSClient(transport, TWO_SERVER_PLAN, trainer=0)
    for call in range(3):
        client.kept.sent([[PushPullRequest(0, call)], [PushPullRequest(0, call)]])
    client.kept.release(0, 1)
    client.next_call = 3
    transport.restarts = 1
    client.push_pull({}, {}, {}).wait()
    assert transport.sent == [(0, "push_pulls", [2, 3]), (1, "push_pulls", [0, 1, 2, 3])]
    transport.sent.clear()
    client.push_pull({}, {}, {}).wait()  # kept calls go again only after another restart
    assert transport.sent == [(0, "push_pull", [4]), (1, "push_pull", [4])]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({}, "--publish-dir"),
        ({"publish_dir": "log", "mode": "ssp"}, "sync and async"),
        ({"publish_dir": "log", "launcher": "threads"}, "processes or torchrun"),
        ({"publish_dir": "log", "recover_wait": 0.0}, "--recover-wait"),
    ],
)
def test_recover_is_refused_where_it_cannot_work(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ps.ConfigError, match=message):
        ps.TrainConfig(recover=True, **{"launcher": "processes", **changes})
