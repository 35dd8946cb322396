"""Serving (paramserver.serving): a served model follows training servers' change logs version
by version, answers tritonclient over HTTP and gRPC, and refuses bad requests and broken
chains without changing what it serves.

The training servers here are real stores (paramserver.store) with real publishers writing
real files; the clients are tritonclient's, unchanged."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from torch import Tensor
from tritonclient.utils import InferenceServerException

from paramserver.changelog.log import MANIFEST, ChainFollower, LogWriter, server_dir
from paramserver.changelog.publisher import Publisher
from paramserver.changelog.segment import Segment, TableChanges
from paramserver.errors import ConfigError
from paramserver.modelplan import build_model, plan_of
from paramserver.optimconfig import OptimizerConfig
from paramserver.serving.follow import Follower
from paramserver.serving.frontend import Frontend
from paramserver.serving.grpc import GrpcServing
from paramserver.serving.http import MAX_BODY_BYTES, HttpServing
from paramserver.serving.model import ServedModel
from paramserver.serving.run import serve
from paramserver.store.snapshot import restore_store, snapshot_store
from paramserver.store.store import Store
from paramserver.store.table import Reading
from tests.procs import free_port
from tests.serving_helpers import EXAMPLE, Ranker, raw_http

SERVERS = 2


class Training:
    """Two training servers' stores of Ranker, each publishing into ``root``."""

    def __init__(self, root: Path, aligned: bool = False, keep: int = 3600):
        self.built = build_model(Ranker, 0)
        self.plan, self.aligned, self.step = plan_of(self.built.model, SERVERS), aligned, 0
        self.keep = keep  # segments each log keeps (the job's --publish-keep)
        self.stores = [self.new_store(s) for s in range(SERVERS)]
        self.publishers = [self.publisher(store, root, "job") for store in self.stores]

    def publisher(self, store: Store, root: Path, writer: str) -> Publisher:
        """A sync job's publisher cuts when told; an async job's on a timer (here never)."""
        return Publisher(store, root, writer, every_s=3600, timed=not self.aligned, keep=self.keep)

    def new_store(self, server: int) -> Store:
        """Server ``server``'s store as the job starts it."""
        rule = OptimizerConfig(name="sgd", lr=0.5)
        dense = {n: p.detach() for n, p in self.built.model.named_parameters()
                 if n in self.plan.dense}  # fmt: skip
        rules = dict.fromkeys(self.plan.tables, rule)
        return Store(server, self.plan, dense, self.built.inits, rule, rules)

    def train(self, items: list[int], users: list[int]) -> None:
        """One step: every row of ``items`` and ``users`` (and every dense value) updated."""
        self.step += 1
        for store in self.stores:
            store.advance_clock(self.step)
            for table, ids in (("item.weight", items), ("user.weight", users)):
                mine = torch.tensor(ids)[
                    self.plan.server_of_rows(table, torch.tensor(ids)) == store.server
                ]
                mine = mine.unique()
                if not mine.numel():
                    continue
                store.read({table: mine}, Reading(train=True, clock=self.step))
                grads = torch.full((mine.numel(), 4), -float(self.step))
                store.apply_rows({table: (mine, grads)}, {table: 0.5}, self.step)
            if store.dense:
                store.apply_dense(
                    {n: torch.ones_like(s.value) for n, s in store.dense.items()}, 0.5
                )

    def publish(self) -> None:
        for publisher in self.publishers:
            publisher.cut(self.step, aligned=self.aligned)
        for publisher in self.publishers:
            assert publisher.flush(5.0)

    def rows(self, table: str, ids: list[int]) -> Tensor:
        out = []
        for i in ids:
            store = self.stores[int(self.plan.server_of_rows(table, torch.tensor([i]))[0])]
            out.append(store.read({table: torch.tensor([i])}, Reading()).values[table][0])
        return torch.stack(out)

    def close(self) -> None:
        for publisher in self.publishers:
            publisher.close()


@pytest.fixture
def training(tmp_path: Path):
    job = Training(tmp_path)
    yield job
    job.close()


def follower_of(root: Path) -> tuple[ServedModel, Follower]:
    served = ServedModel(Ranker, 0)
    return served, Follower(served, root)


def test_served_rows_equal_the_training_servers_after_each_version(
    tmp_path: Path, training: Training
) -> None:
    served, follower = follower_of(tmp_path)
    start, _ = served.lookup("item.weight", torch.arange(50))
    assert torch.equal(start, training.rows("item.weight", list(range(50))))  # the same init
    training.train(items=[1, 2, 3], users=[10, 11])
    training.publish()
    assert follower.poll() == SERVERS
    assert torch.equal(served.lookup("item.weight", torch.tensor([1, 2, 3]))[0],
                       training.rows("item.weight", [1, 2, 3]))  # fmt: skip
    assert torch.equal(served.lookup("user.weight", torch.tensor([10, 11]))[0],
                       training.rows("user.weight", [10, 11]))  # fmt: skip
    unseen, version = served.lookup("user.weight", torch.tensor([99]))
    assert torch.equal(unseen, torch.full((1, 4), 0.5))  # the default
    assert version.number == 2  # segment 1 of server 0's chain and of server 1's
    assert served.store.tables["user.weight"].stats()["rows"] == 2  # serving made no row
    for name, slot in served.store.dense.items():
        owner = training.stores[training.plan.dense_server[name]]
        assert torch.equal(slot.value, owner.dense[name].value)


def test_a_sync_version_holds_every_servers_segments_of_one_step(tmp_path: Path) -> None:
    training = Training(tmp_path, aligned=True)
    served, follower = follower_of(tmp_path)
    try:
        training.train(items=[1, 2], users=[10])
        training.publish()
        training.train(items=[1, 2], users=[10])
        training.publishers[0].cut(training.step, aligned=True)  # server 1 has not cut step 2
        assert training.publishers[0].flush(5.0)
        assert follower.poll() == SERVERS  # step 1 only
        assert served.version.steps == {0: 1, 1: 1}
        training.publishers[1].cut(training.step, aligned=True)
        assert training.publishers[1].flush(5.0)
        assert follower.poll() == SERVERS and served.version.steps == {0: 2, 1: 2}
    finally:
        training.close()


def test_a_broken_chain_is_refused_and_the_last_good_version_stays_served(
    tmp_path: Path, training: Training
) -> None:
    served, follower = follower_of(tmp_path)
    training.train(items=[1], users=[10])
    training.publish()
    follower.poll()
    good = served.lookup("item.weight", torch.tensor([1]))[0]
    training.train(items=[1], users=[10])
    training.publish()
    manifest = server_dir(tmp_path, 1) / MANIFEST
    document = json.loads(manifest.read_text())
    document["segments"][-1]["previous"] = 0  # a segment claiming to follow the chain's start
    manifest.write_text(json.dumps(document))
    follower.poll()
    assert 1 in follower.problems and "segment-000000000002" in follower.problems[1]
    assert served.version.segments == {0: 2, 1: 1}  # server 0 went on, server 1 stayed
    if int(training.plan.server_of_rows("item.weight", torch.tensor([1]))[0]) == 1:
        assert torch.equal(served.lookup("item.weight", torch.tensor([1]))[0], good)


@pytest.fixture
def serving(tmp_path: Path):
    served = ServedModel(Ranker, 0)
    frontend = Frontend(served, example=EXAMPLE)
    frontend.ready = True
    http, grpc = HttpServing(frontend), GrpcServing(frontend)
    yield served, http, grpc
    http.close()
    grpc.close()


def test_tritonclient_over_http_and_grpc_reads_what_is_served(serving) -> None:
    served, http, grpc = serving
    ids = np.array([3, 4, 5, 5, 6, 7], dtype=np.int64)
    expected, _ = served.lookup("item.weight", torch.from_numpy(ids))
    for client, module in (
        (triton_http.InferenceServerClient(f"127.0.0.1:{http.port}"), triton_http),
        (triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc.port}"), triton_grpc),
    ):
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("model") and client.is_model_ready("item.weight")
        lookup = module.InferInput("ids", list(ids.shape), "INT64")
        lookup.set_data_from_numpy(ids)
        rows = client.infer("item.weight", [lookup]).as_numpy("rows")
        assert rows.shape == (6, 4) and np.array_equal(rows, expected.numpy())
        items = module.InferInput("items", [2], "INT64")
        items.set_data_from_numpy(EXAMPLE[0].numpy())
        users = module.InferInput("users", [2], "INT64")
        users.set_data_from_numpy(EXAMPLE[1].numpy())
        scores = client.infer("model", [items, users]).as_numpy("output")
        assert np.array_equal(scores, served.predict(EXAMPLE)[0].numpy())


@pytest.mark.parametrize(
    ("model", "name", "datatype", "values", "message"),
    [
        ("nope", "ids", "INT64", [1], "no model 'nope'"),
        ("item.weight", "ids", "INT64", [1, 50], "must be in 0..49"),
        ("item.weight", "ids", "INT32", [1], "must be INT64"),
        ("item.weight", "wrong", "INT64", [1], "takes the inputs"),
        ("model", "items", "FP32", [1.0], "takes the inputs"),
    ],
)
def test_a_bad_request_gets_the_protocols_error_and_changes_nothing(
    serving, model: str, name: str, datatype: str, values: list, message: str
) -> None:
    served, http, grpc = serving
    before = served.lookup("item.weight", torch.arange(50))[0]
    for client, module in (
        (triton_http.InferenceServerClient(f"127.0.0.1:{http.port}"), triton_http),
        (triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc.port}"), triton_grpc),
    ):
        given = module.InferInput(name, [len(values)], datatype)
        given.set_data_from_numpy(np.array(values, dtype=triton_http.triton_to_np_dtype(datatype)))
        with pytest.raises(InferenceServerException, match=message):
            client.infer(model, [given])
        assert client.is_server_ready()
    assert torch.equal(served.lookup("item.weight", torch.arange(50))[0], before)


def test_no_lookup_sees_part_of_a_version(tmp_path: Path) -> None:
    """Each version sets rows 0..39 of ``item.weight`` and every dense value to its number;
    lookups made meanwhile must each see one number throughout."""
    served = ServedModel(Ranker, 0)
    stop, torn, seen = threading.Event(), [], set()

    def apply_versions() -> None:
        number = 0
        while not stop.is_set():
            number += 1
            made = Segment("job", 0, number, number - 1, number, number, number - 1, number)
            ids = torch.arange(40)
            made.tables["item.weight"] = TableChanges(
                ids, torch.full((40, 4), float(number)), torch.zeros(0, dtype=torch.int64)
            )
            served.apply([made])

    writer = threading.Thread(target=apply_versions)
    writer.start()
    try:
        for _ in range(3000):
            rows, version = served.lookup("item.weight", torch.arange(40))
            values = rows.unique()
            if version.number and (values.numel() != 1 or float(values[0]) != version.number):
                torn.append((values.tolist(), version.number))
            seen.add(version.number)
    finally:
        stop.set()
        writer.join()
    assert torn == [] and len(seen) > 10  # versions changed under the lookups, none torn


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "message"),
    [
        ("/v2/models/item.weight/infer", b"{not json", {}, 400, b"not JSON"),
        ("/v2/models/item.weight/infer", b"[1, 2]", {}, 400, b"a list of inputs"),
        ("/v2/models/item.weight/infer",
         json.dumps({"inputs": [{"name": "ids", "shape": [2], "datatype": "INT64",
                                 "data": [1]}]}).encode(), {}, 400, b"1 values for shape"),
        ("/v2/models/model/infer",
         json.dumps({"inputs": [{"name": "items", "shape": [2, 2], "datatype": "INT64",
                                 "data": [1, 2, 3, 4]},
                                {"name": "users", "shape": [2], "datatype": "INT64",
                                 "data": [1, 2]}]}).encode(), {}, 400, b"does not fit"),
        ("/v2/models/item.weight/infer",
         json.dumps({"inputs": [{"name": "ids", "shape": [1 << 23], "datatype": "INT64",
                                 "parameters": {"binary_data_size": 8}}]}).encode() + bytes(8),
         {"Inference-Header-Content-Length": "0"}, 400, b"not JSON"),
        ("/v2/models/item.weight/infer",
         json.dumps({"inputs": [{"name": "ids", "shape": [1 << 23], "datatype": "INT64",
                                 "data": []}]}).encode(), {}, 400, b"over the limit"),
        ("/v2/models/nope/infer", b'{"inputs": []}', {}, 404, b"no model"),
        ("/v2/nothing", b"", {}, 404, b"no such endpoint"),
    ],
    ids=["malformed JSON", "not an object", "too few values", "wrong shape", "bad header length",
         "a huge batch", "unknown model", "unknown path"],
)  # fmt: skip
def test_a_malformed_http_request_gets_its_status_and_serving_goes_on(
    serving, path: str, body: bytes, headers: dict, status: int, message: bytes
) -> None:
    served, http_serving, _ = serving
    before = served.lookup("item.weight", torch.arange(50))[0]
    got, answer = raw_http(http_serving.port, "POST", path, body, headers)
    assert got == status and message in answer, answer
    assert raw_http(http_serving.port, "GET", "/v2/health/ready", b"")[0] == 200
    assert torch.equal(served.lookup("item.weight", torch.arange(50))[0], before)


def test_a_body_over_the_limit_is_refused_before_it_is_read(serving) -> None:
    _, http_serving, _ = serving
    connection = http.client.HTTPConnection("127.0.0.1", http_serving.port, timeout=30)
    connection.putrequest("POST", "/v2/models/item.weight/infer")
    connection.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
    connection.endheaders()
    answer = connection.getresponse()
    assert answer.status == 413 and b"the limit is" in answer.read()


def test_a_malformed_protobuf_gets_the_protocols_error_and_serving_goes_on(serving) -> None:
    _, _, grpc_serving = serving
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_serving.port}")
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    with pytest.raises(grpc.RpcError) as refused:
        infer(b"\xff\xff\xff not a protobuf", timeout=10)
    assert refused.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    client = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_serving.port}")
    assert client.is_server_ready()
    channel.close()


def test_a_full_segment_deletes_the_served_ids_its_server_no_longer_holds(
    tmp_path: Path, training: Training
) -> None:
    """A training server resumed from a checkpoint taken before some of its ids were made
    publishes a full segment: serving drops those ids (they read as the default again) and
    keeps every id of the other server."""
    served, follower = follower_of(tmp_path)
    users = torch.arange(10, 30)
    owners = training.plan.server_of_rows("user.weight", users)
    resumed_server = int(owners[0])
    mine, others = users[owners == resumed_server].tolist(), users[owners != resumed_server]
    kept, later, other = mine[:2], mine[2:4], others[:2].tolist()
    training.train(items=[1], users=kept + other)
    training.publish()
    saved = snapshot_store(training.stores[resumed_server])
    training.train(items=[1], users=later)
    training.publish()
    assert follower.poll() == 2 * SERVERS
    assert not torch.equal(served.lookup("user.weight", torch.tensor(later))[0],
                           torch.full((2, 4), 0.5))  # fmt: skip

    training.publishers[resumed_server].close()
    resumed = training.new_store(resumed_server)
    restore_store(resumed, [saved])
    training.stores[resumed_server] = resumed
    training.publishers[resumed_server] = training.publisher(resumed, tmp_path, "job-resumed")
    assert training.publishers[resumed_server].flush(5.0)
    assert follower.poll() == 1 and follower.problems == {}
    assert torch.equal(served.lookup("user.weight", torch.tensor(later))[0],
                       torch.full((2, 4), 0.5))  # fmt: skip
    for ids in (kept, other):
        assert torch.equal(served.lookup("user.weight", torch.tensor(ids))[0],
                           training.rows("user.weight", ids))  # fmt: skip


def item_segment(server: int, step: int, value: float, *, table: str = "item.weight",
                 aligned: bool = False) -> Segment:  # fmt: skip
    """A segment of server ``server`` (of SERVERS) at ``step``: rows 0..3 of ``table`` set
    to ``value``."""
    made = Segment("job", server, 0, 0, step, step, step - 1, step, aligned=aligned,
                   servers=SERVERS)  # fmt: skip
    made.tables[table] = TableChanges(
        torch.arange(4), torch.full((4, 4), value), torch.zeros(0, dtype=torch.int64)
    )
    return made


def test_a_sync_version_waits_for_a_server_that_has_not_published_yet(tmp_path: Path) -> None:
    writer = LogWriter(tmp_path, "job", 0)
    writer.append(item_segment(0, 1, 1.0, aligned=True))
    served, follower = follower_of(tmp_path)  # server 1's directory is not there yet
    assert follower.poll() == 0 and served.version.number == 0
    LogWriter(tmp_path, "job", 1).append(item_segment(1, 1, 1.0, aligned=True))
    assert follower.poll() == SERVERS and served.version.steps == {0: 1, 1: 1}


def test_a_segment_that_does_not_fit_the_model_refuses_only_its_server(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    LogWriter(tmp_path, "job", 0).append(item_segment(0, 1, 1.0))
    LogWriter(tmp_path, "job", 1).append(item_segment(1, 1, 1.0, table="nope.weight"))
    served, follower = follower_of(tmp_path)
    with caplog.at_level("ERROR"):
        assert follower.poll() == 1 and follower.poll() == 0
    assert served.version.segments == {0: 1}
    assert "no such table" in follower.problems[1] and 0 not in follower.problems
    assert sum("server 1" in r.message for r in caplog.records) == 1  # logged once
    assert follower.metrics.segments == {"applied": 1, "refused": 1}


def test_a_follower_far_behind_catches_up_a_bounded_number_of_segments_at_a_time(
    tmp_path: Path,
) -> None:
    writer = LogWriter(tmp_path, "job", 0)
    for step in range(1, 8):
        writer.append(item_segment(0, step, float(step)))
    served = ServedModel(Ranker, 0)
    follower = Follower(served, tmp_path, poll_s=0.01)
    follower.chains[0] = ChainFollower(tmp_path, 0, most=3)
    assert follower.poll() == 3 and follower.chains[0].more
    follower.start()
    try:
        deadline = time.monotonic() + 10
        while served.version.segments.get(0) != 7 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        follower.close()
    assert served.version.segments == {0: 7} and not follower.chains[0].more
    assert torch.equal(served.lookup("item.weight", torch.arange(4))[0], torch.full((4, 4), 7.0))


def test_tables_mapped_from_files_serve_what_tables_in_memory_serve(tmp_path: Path) -> None:
    in_memory, mapped = ServedModel(Ranker, 0), ServedModel(Ranker, 0, mmap_dir=tmp_path)
    for served in (in_memory, mapped):
        served.apply([item_segment(0, 1, 3.0)])
    for table, ids in (("item.weight", torch.arange(50)), ("user.weight", torch.tensor([7]))):
        assert torch.equal(mapped.lookup(table, ids)[0], in_memory.lookup(table, ids)[0])
    assert torch.equal(mapped.predict(EXAMPLE)[0], in_memory.predict(EXAMPLE)[0])
    maps = Path("/proc/self/maps").read_text()
    assert f"{tmp_path}/rows-" in maps and list(tmp_path.iterdir()) == []  # mapped, unlinked


def test_version_numbers_rise_and_a_restarted_follower_answers_the_number_it_left_at(
    tmp_path: Path, training: Training
) -> None:
    """A version's number is its place in the chains (each server's last segment applied,
    summed): every version raises it, and a serving process restarted on the same log
    answers the number the one before it reached, then rises on from it."""
    served, follower = follower_of(tmp_path)
    numbers = []
    for step in range(3):
        training.train(items=[1 + step], users=[10])
        training.publish()
        assert follower.poll() == SERVERS
        numbers.append(served.version.number)
    assert numbers == [2, 4, 6]
    restarted, again = follower_of(tmp_path)
    again.catch_up()  # one version of three segments each
    assert restarted.version.number == numbers[-1]
    training.train(items=[9], users=[10])
    training.publish()
    assert again.poll() == SERVERS and restarted.version.number == 8


def test_a_follower_is_told_when_its_log_no_longer_holds_what_it_needs_next(
    tmp_path: Path,
) -> None:
    """A log pruned (each keeps one segment here) past the base, or past what a follower
    applied, is a gap: a serving process does not start on it."""
    training = Training(tmp_path, keep=1)
    try:
        _, follower = follower_of(tmp_path)
        training.train(items=[1], users=[10])
        training.publish()
        assert follower.gaps() == {} and follower.poll() == SERVERS  # from the start
        for _ in range(2):
            training.train(items=[2], users=[11])
            training.publish()
        assert set(follower.gaps()) == {0, 1}
        assert "oldest segment kept is 3, but the last applied is 1" in follower.gaps()[0]
        late_served, late = follower_of(tmp_path)  # from the job's initial model
        assert "no longer reaches back to the base" in late.gaps()[1]
        assert late_served.version.number == 0
    finally:
        training.close()


def test_serve_refuses_a_log_pruned_past_the_initial_model_before_it_listens(
    tmp_path: Path,
) -> None:
    training = Training(tmp_path, keep=1)
    try:
        for step in range(2):
            training.train(items=[1 + step], users=[10])
            training.publish()
        port = free_port()
        with pytest.raises(ConfigError, match=r"no longer reach back to the job's initial "
                           r"model .*no --checkpoint-dir.*pass --from"):  # fmt: skip
            serve(Ranker, follow=tmp_path, example_inputs=EXAMPLE, http_port=port,
                  grpc_port=None)  # fmt: skip
        with pytest.raises(ConnectionRefusedError):  # nothing listened
            raw_http(port, "GET", "/v2/health/ready", b"")
    finally:
        training.close()
