"""Dynamic (hashed) tables: admission, eviction and training end to end (their id map:
tests/test_idmap.py; their storage: tests/test_row_storage.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.futures import Future

import paramserver as ps
from paramserver.baseline import train_single_process
from paramserver.embedding import DynamicOptions
from paramserver.launch.roles import build_server
from paramserver.optim import make_rule
from paramserver.optimconfig import OptimizerConfig
from paramserver.server.endpoint import ServerEndpoint
from paramserver.sharding import ShardPlan, TableSpec
from paramserver.store.dynamic import DynamicTable
from paramserver.store.pulls import PULLS_KEPT
from paramserver.store.rowinit import init_rows
from paramserver.store.table import Reading
from paramserver.wire.messages import PushPullRequest, RowBlock
from tests.helpers import EXTREMES, NUM_IDS, HashedModel, hashed_batches, mse


def table(momentum: float = 0.0, **options: object) -> DynamicTable:
    spec = TableSpec("emb.weight", 0, 4, torch.float32, dynamic=DynamicOptions(**options))  # type: ignore[arg-type]
    return DynamicTable(spec, make_rule(OptimizerConfig(name="sgd", lr=1.0, momentum=momentum)))


def ids(*values: int) -> Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_admission_counts_are_exact_on_a_scripted_sequence() -> None:
    t = table(min_count=3, ttl_steps=1000, default_value=-1.0)
    default = torch.full((1, 4), -1.0)
    assert torch.equal(t.read(ids(10, 20), Reading(train=True, clock=1)), default.expand(2, 4))
    assert torch.equal(t.read(ids(10), Reading(train=True, clock=2)), default)
    assert t.stats()["rows"] == 0 and t.stats()["pending_ids"] == 2
    # Gradients for ids still pending are dropped: nothing is kept but their counters.
    assert t.apply(ids(10), torch.ones(1, 4), clock=2, lr=1.0) == 0
    row = t.read(ids(10, 20), Reading(train=True, clock=3))  # third sighting of 10: admitted
    torch.testing.assert_close(row[0], init_rows("emb.weight", t.options, ids(10), 4)[0])
    assert torch.equal(row[1], default[0])
    stats = t.stats()
    assert (stats["rows"], stats["admitted"], stats["pending_ids"]) == (1, 1, 1)
    assert stats["lookups"] == 5 and stats["dropped_grads"] == 1
    # Evaluation reads create and count nothing.
    assert torch.equal(t.read(ids(20, 30), Reading(train=False, clock=4)), default.expand(2, 4))
    assert t.stats()["lookups"] == 5 and t.stats()["pending_ids"] == 1


def test_ttl_and_capacity_eviction_are_exact_and_returning_ids_start_fresh() -> None:
    t = table(momentum=0.9, ttl_steps=4, capacity=20)
    t.read(torch.arange(10), Reading(train=True, clock=1))
    t.apply(torch.arange(10), torch.ones(10, 4), clock=1, lr=1.0)  # rows move away from init
    t.read(torch.arange(5, 15), Reading(train=True, clock=3))  # touches 5..9, creates 10..14
    assert t.stats()["rows"] == 15
    t.read(ids(100), Reading(train=True, clock=6))  # sweep: untouched since clock 1 (< 6 - 4): 0..4
    assert t.stats()["rows"] == 11 and t.stats()["evicted"] == 5
    assert (t.ids.lookup(torch.arange(5)) == -1).all()
    # Above capacity 20, the least recently touched rows go, down to 95% (19 rows).
    t.read(torch.arange(200, 210), Reading(train=True, clock=7))  # 21 rows
    assert t.stats()["rows"] == 19 and t.stats()["evicted"] == 7
    assert (t.ids.lookup(ids(5, 6)) == -1).all()  # touched at clock 3, the oldest
    assert (t.ids.lookup(ids(7, 8, 9, 10, 100)) >= 0).all()
    # An evicted id that returns starts again from the init rule, with fresh optimizer state.
    again = t.read(ids(5), Reading(train=True, clock=8))
    torch.testing.assert_close(again, init_rows("emb.weight", t.options, ids(5), 4))
    row = int(t.ids.lookup(ids(5)))
    assert t.steps is not None and float(t.steps[row]) == 0
    assert float(t.state["momentum_buffer"][row].abs().sum()) == 0


def test_reads_of_one_step_admit_alike_and_keep_each_others_rows() -> None:
    """Admission counts the calls of earlier steps and the reading one, not the others of its
    step, so first calls (step 0, in any order) answer alike; capacity spares the rows a
    step's reads handed out, so a later read of the step does not evict an earlier one's."""

    def first_calls(order: list[int]) -> tuple[list[Tensor], dict[str, int]]:
        t = table(min_count=2, ttl_steps=100)
        batches = [ids(1, 2), ids(2, 3)]
        answers = {
            trainer: t.read(batches[trainer], Reading(train=True, clock=0)) for trainer in order
        }
        t.read(ids(2, 4), Reading(train=True, clock=1))  # 2 was seen at an earlier step: admitted
        return [answers[0], answers[1]], t.stats()

    answers, stats = first_calls([0, 1])
    again, stats_again = first_calls([1, 0])
    assert all(torch.equal(a, b) for a, b in zip(answers, again, strict=True))
    assert stats == stats_again and (stats["rows"], stats["pending_ids"]) == (1, 3)
    assert torch.equal(answers[0][1], torch.zeros(4))  # 2: seen twice at step 0, pending

    t = table(capacity=4, ttl_steps=100)
    t.read(ids(1, 2, 3, 4), Reading(train=True, clock=1))
    t.read(ids(1, 5), Reading(train=True, clock=2))  # trainer 0: 2 and 3 go (5 rows, down to 95%)
    t.read(ids(6, 7), Reading(train=True, clock=2))  # trainer 1: only 4 goes, not 0's rows 1 and 5
    assert t.ids.live_rows()[0].tolist() == [1, 5, 6, 7]
    assert t.stats()["evicted"] == 3


def test_a_gradient_goes_only_to_the_row_it_was_computed_from() -> None:
    """An id evicted and admitted again between a pull and its push has a new row: the push's
    gradient, computed from the old one, is dropped, like one for an id pending at the pull;
    the other ids' gradients apply. A push that names no pull goes to the current rows."""
    t = table(min_count=2, ttl_steps=2)
    t.read(ids(1, 2), Reading(train=True, clock=1))
    t.read(ids(1, 2, 3), Reading(train=True, clock=2, pull=(0, 2)))  # trainer 0's call 2: 3 pending
    t.read(ids(2, 3), Reading(train=True, clock=5, pull=(1, 5)))  # 1 expires, 3 is admitted
    assert int(t.ids.lookup(ids(1))) == -1
    t.read(ids(1), Reading(train=True, clock=6, pull=(1, 6)))
    t.read(ids(1), Reading(train=True, clock=7, pull=(1, 7)))  # 1 is back: a new row
    before = t.read(ids(1, 2, 3), Reading(train=False, clock=7))
    grads = torch.ones(3, 4)
    assert t.apply(ids(1, 2, 3), grads, clock=7, pull=(0, 2), lr=1.0) == 1  # only 2's
    after = t.read(ids(1, 2, 3), Reading(train=False, clock=7))
    assert torch.equal(after[0], before[0]) and torch.equal(after[2], before[2])
    torch.testing.assert_close(after[1], before[1] - 1)
    assert t.stats()["dropped_grads"] == 2
    # The same check before a sync round sums trainers' gradients. The pull's record serves
    # every push computed from that read (grouped steps push several), until newer reads of
    # the same trainer push it out.
    t.read(ids(1, 2), Reading(train=True, clock=7, pull=(0, 7)))
    t.read(ids(4), Reading(train=True, clock=20, pull=(1, 20)))  # 1 and 2 expire...
    t.read(ids(1), Reading(train=True, clock=21, pull=(1, 21)))
    t.read(ids(1), Reading(train=True, clock=22, pull=(1, 22)))  # ...and 1 comes back
    kept = t.rows_still_pulled(ids(1, 2), (0, 7))
    assert kept is not None and kept.tolist() == [False, False]
    again = t.rows_still_pulled(ids(1, 2), (0, 7))
    assert again is not None and again.tolist() == [False, False]
    for call in range(8, 8 + PULLS_KEPT):
        t.read(ids(4), Reading(train=True, clock=22, pull=(0, call)))
    assert t.rows_still_pulled(ids(1, 2), (0, 7)) is None  # pushed out: no record left
    before = t.read(ids(1), Reading(train=False, clock=22))
    t.apply(ids(1), torch.ones(1, 4), clock=22, lr=1.0)  # no pull named: the current row
    torch.testing.assert_close(t.read(ids(1), Reading(train=False, clock=22)), before - 1)


class CappedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = ps.DynamicEmbedding(4, capacity=6, init_scale=0.1)
        self.out = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.emb(x)).squeeze(-1)


def capped_server(mode: str, trainers: int, **overrides: Any) -> ServerEndpoint:
    config = ps.TrainConfig(
        servers=1, trainers=trainers, mode=mode, optimizer="sgd", lr=1.0, **overrides
    )  # type: ignore[arg-type]
    return build_server(0, config, CappedModel)


def call(server: ServerEndpoint, trainer: int, step: int, **fields: Any) -> Future:
    request = PushPullRequest(trainer, step, pull_dense=False, **fields)
    return server.coordinator.push_pull(request)


def test_an_async_push_skips_a_row_replaced_since_its_pull() -> None:
    server = capped_server("async", trainers=2)
    emb = server.shard.store.tables["emb.weight"]
    x = ids(1000)
    call(server, 0, 0, pull_rows={"emb.weight": x}).wait()  # trainer 0 reads x at step 0
    call(server, 1, 0).wait()
    call(server, 1, 1, pull_rows={"emb.weight": torch.arange(100, 106)}).wait()  # x evicted
    assert int(emb.ids.lookup(x)) == -1
    call(server, 1, 2, pull_rows={"emb.weight": x}).wait()  # x admitted again
    fresh = emb.read(x, Reading(train=False, clock=2))
    grads = {"emb.weight": RowBlock(x, torch.ones(1, 4))}
    call(server, 0, 1, grads_call=0, row_grads=grads).wait()
    assert torch.equal(emb.read(x, Reading(train=False, clock=2)), fresh)
    assert emb.stats()["dropped_grads"] == 1


def test_a_sync_round_skips_a_row_replaced_since_its_pull() -> None:
    """Round 1 closes at its deadline with trainer 0 alone, who reads x; before round 2 sums
    its gradient, late calls of the others evict x (capacity 6) and admit it again."""
    server = capped_server("sync", trainers=3, round_deadline=0.5, min_contributors=1)
    emb = server.shard.store.tables["emb.weight"]
    x = ids(1000)
    for trainer in range(3):
        call(server, trainer, 0).wait()
    first = call(server, 0, 1, pull_rows={"emb.weight": x})
    server.coordinator.check_liveness(time.monotonic() + 1.0)
    first.wait()
    grads = {"emb.weight": RowBlock(x, torch.ones(1, 4))}
    pushed = call(server, 0, 2, grads_call=1, row_grads=grads)  # waits in round 2
    call(server, 1, 1, pull_rows={"emb.weight": torch.arange(100, 106)}).wait()  # x evicted
    assert int(emb.ids.lookup(x)) == -1
    call(server, 2, 1, pull_rows={"emb.weight": x}).wait()  # x admitted again
    fresh = emb.read(x, Reading(train=False, clock=2))
    server.coordinator.check_liveness(time.monotonic() + 1.0)
    pushed.wait()
    assert torch.equal(emb.read(x, Reading(train=False, clock=2)), fresh)
    torch.testing.assert_close(fresh, init_rows("emb.weight", emb.options, x, 4))
    assert emb.stats()["dropped_grads"] == 1


class AdmittingModel(nn.Module):
    """One dynamic table that admits an id seen in 2 calls (within 100 steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = ps.DynamicEmbedding(4, min_count=2, ttl_steps=100, init_scale=0.1)
        self.out = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.emb(x)).squeeze(-1)


@pytest.mark.parametrize("overtaken", [False, True])
def test_a_sync_initial_read_counts_at_step_0_whatever_arrived_before_it(overtaken: bool) -> None:
    """Trainer 0's call 0 reads x at step 0 even when trainer 1's call 1 (waiting in round 1)
    reached the server first, so trainer 1's read of x in round 1 is its second sighting from
    an earlier step: x is admitted in either arrival order."""
    config = ps.TrainConfig(servers=1, trainers=2, mode="sync", optimizer="sgd", lr=1.0)
    server = build_server(0, config, AdmittingModel)
    try:
        emb = server.shard.store.tables["emb.weight"]
        x = ids(1000)
        if not overtaken:
            call(server, 0, 0, pull_rows={"emb.weight": x}).wait()
        call(server, 1, 0).wait()
        round_1 = call(server, 1, 1, pull_rows={"emb.weight": x})
        if overtaken:
            call(server, 0, 0, pull_rows={"emb.weight": x}).wait()
        call(server, 0, 1).wait()  # closes round 1
        read = round_1.wait().rows["emb.weight"]
        torch.testing.assert_close(read, init_rows("emb.weight", emb.options, x, 4))
        stats = emb.stats()
        assert (stats["rows"], stats["admitted"], stats["pending_ids"]) == (1, 1, 0)
    finally:
        server.coordinator.close()


def test_init_rule_is_a_pure_function_of_table_seed_and_id() -> None:
    options = DynamicOptions(init_scale=0.5, seed=3)
    a = init_rows("t", options, ids(1, 2, 3), 8)
    assert torch.equal(a, init_rows("t", options, ids(3, 2, 1), 8).flip(0))
    assert not torch.equal(a, init_rows("u", options, ids(1, 2, 3), 8))
    assert not torch.equal(
        a, init_rows("t", DynamicOptions(init_scale=0.5, seed=4), ids(1, 2, 3), 8)
    )
    assert float(a.abs().max()) <= 0.5 and float(a.std()) > 0.1


def test_dynamic_ids_route_by_bucket_to_every_server() -> None:
    spec = TableSpec("t", 0, 4, torch.float32, dynamic=DynamicOptions())
    plan = ShardPlan([], [spec], num_servers=3)
    values = torch.cat([torch.tensor(EXTREMES), torch.randint(-(2**62), 2**62, (3000,))])
    servers = plan.server_of_rows("t", values)
    assert set(servers.tolist()) == {0, 1, 2}
    counts = torch.bincount(servers, minlength=3)
    assert int(counts.min()) > 800  # roughly balanced
    assert torch.equal(servers, plan.server_of_rows("t", values.clone()))


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_dynamic_tables_train_to_the_same_rows_as_fixed_tables(optimizer: str) -> None:
    config = ps.TrainConfig(
        servers=2,
        trainers=3,
        mode="sync",
        optimizer=optimizer,
        lr=0.05,
        launcher="threads",
        progress=False,
    )
    data = lambda t, n: hashed_batches(t)  # noqa: E731
    fixed = ps.train(lambda: HashedModel(dynamic=False), data, mse, config)
    dynamic = ps.train(lambda: HashedModel(dynamic=True), data, mse, config)
    assert fixed is not None and dynamic is not None
    learned = dynamic.model.state_dict()
    seen = torch.cat([b for t in range(3) for b, _ in hashed_batches(t)]).unique()
    assert torch.equal(learned["emb.ids"], seen)
    expected = fixed.model.state_dict()
    torch.testing.assert_close(learned["emb.weight"], expected["emb.weight"][seen])
    torch.testing.assert_close(learned["out.weight"], expected["out.weight"])
    assert dynamic.summary["tables"]["emb.weight"]["rows"] == seen.numel()
    assert dynamic.summary["tables"]["emb.weight"]["admitted"] == seen.numel()


def test_huge_and_negative_ids_train_and_unseen_ids_read_the_default() -> None:
    pool = torch.tensor(EXTREMES + [2**40 + i for i in range(30)])

    def data(trainer: int, num_trainers: int):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(trainer)
        for _ in range(10):
            yield pool[torch.randint(0, pool.numel(), (16, 2), generator=g)], torch.randn(16)

    config = ps.TrainConfig(servers=3, trainers=2, launcher="threads", progress=False)
    result = ps.train(lambda: HashedModel(dynamic=True), data, mse, config)
    assert result is not None
    model = result.model
    assert set(model.emb.ids.tolist()) <= set(pool.tolist())
    assert model.emb.ids.numel() >= pool.numel() - 5
    unseen = torch.tensor([[424242, 777]])
    expected = model.out(torch.zeros(1, 4)).squeeze(1)  # the default vector is zeros
    torch.testing.assert_close(model(unseen), expected)
    reloaded = HashedModel(dynamic=True)
    reloaded.load_state_dict(model.state_dict())
    probe = pool[:6].reshape(3, 2)
    torch.testing.assert_close(reloaded(probe), model(probe))


def test_bad_dynamic_options_and_state_dicts_are_refused() -> None:
    with pytest.raises(ValueError, match="needs ttl_steps"):
        ps.DynamicEmbedding(4, min_count=2)
    module = ps.DynamicEmbedding(4)
    with pytest.raises(ValueError, match="sorted, unique"):
        module.load_state_dict({"ids": ids(3, 1), "weight": torch.zeros(2, 4)})
    with pytest.raises(ValueError, match="one per row"):
        module.load_state_dict({"ids": ids(1, 3), "weight": torch.zeros(3, 4)})


class ThreeHashedTables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = ps.DynamicEmbedding(4, init_scale=0.1)
        self.b = ps.DynamicEmbedding(4, init_scale=0.5, seed=3)
        self.c = ps.DynamicEmbedding(8)

    def forward(self, ids: Tensor) -> Tensor:
        return self.a(ids).sum(1) + self.b(ids).sum(1) + self.c(ids).sum(1)


def test_one_read_of_several_tables_makes_each_tables_own_rows() -> None:
    """A request reading every dynamic table of a server (one search and one insert in their
    shared id map) gives each table the rows its own read would: its init rule; the same id
    in several tables is a row of each. Tables of one width share row storage (a and b: rows
    numbered together, none shared); c, wider, has its own."""
    endpoint = build_server(0, ps.TrainConfig(servers=1, trainers=1), ThreeHashedTables)
    try:
        wanted = {"a.weight": ids(1, 5, 9), "b.weight": ids(5, 7), "c.weight": ids(-3, 5)}
        reply = endpoint.coordinator.push_pull(PushPullRequest(0, 0, pull_rows=wanted)).wait()
        rows = {}
        for name, table_ids in wanted.items():
            table = endpoint.shard.store.tables[name]
            expected = init_rows(name, table.options, table_ids, table.spec.dim)
            torch.testing.assert_close(reply.rows[name], expected, rtol=0, atol=0)
            assert table.stats()["rows"] == table_ids.numel()
            rows[name] = table.ids.live_rows()[1]
            torch.testing.assert_close(table.weight[rows[name]], expected, rtol=0, atol=0)
        tables = endpoint.shard.store.tables
        assert tables["a.weight"].weight is tables["b.weight"].weight
        assert tables["c.weight"].weight is not tables["a.weight"].weight
        shared = torch.cat([rows["a.weight"], rows["b.weight"]]).sort().values
        assert torch.equal(shared, torch.arange(5))
        assert torch.equal(rows["c.weight"].sort().values, torch.arange(2))
    finally:
        endpoint.coordinator.close()


class CountingAndNot(nn.Module):
    """Three dynamic tables of one width (so one arena): one admits ids seen twice, one at
    once, one evicts after 3 steps."""

    def __init__(self) -> None:
        super().__init__()
        self.counting = ps.DynamicEmbedding(4, min_count=2, ttl_steps=50, default_value=-1.0)
        self.at_once = ps.DynamicEmbedding(4, seed=5)
        self.expiring = ps.DynamicEmbedding(4, ttl_steps=3, seed=7)

    def forward(self, ids: Tensor) -> Tensor:
        return (self.counting(ids) + self.at_once(ids) + self.expiring(ids)).sum(1)


def test_tables_read_together_admit_and_evict_as_each_would_alone() -> None:
    """A server reads its dynamic tables together (one arena, one search, one insert, their
    admissions decided at once), tables that count sightings, admit at once and evict mixed:
    every read and every table's counters equal those of the same table read alone."""
    endpoint = build_server(0, ps.TrainConfig(servers=1, trainers=1, lr=0.5), CountingAndNot)
    names = ["counting.weight", "at_once.weight", "expiring.weight"]
    shard = endpoint.shard
    rule = OptimizerConfig(name="adagrad", lr=0.5)
    alone = {n: DynamicTable(shard.plan.tables[n], make_rule(rule)) for n in names}
    assert shard.store.tables[names[0]].weight is shard.store.tables[names[2]].weight
    g = torch.Generator().manual_seed(0)
    last: dict[str, Tensor] = {}
    try:
        for call in range(30):
            wanted = {n: torch.randint(0, 150, (12,), generator=g).unique() for n in names}
            pushed = {}
            if call:
                pushed = {
                    n: RowBlock(w, torch.rand(w.numel(), 4, generator=g)) for n, w in last.items()
                }
            request = PushPullRequest(
                0, call, pull_rows=wanted, row_grads=pushed, grads_call=call - 1
            )
            reply = endpoint.coordinator.push_pull(request).wait()
            for name in names:
                table = alone[name]
                if call:
                    table.apply(last[name], pushed[name].values, call, (0, call - 1), lr=0.5)
                own = table.read(wanted[name], Reading(train=True, clock=call, pull=(0, call)))
                torch.testing.assert_close(reply.rows[name], own, rtol=0, atol=0)
            last = wanted
        for name in names:
            together, own = shard.store.tables[name].stats(), alone[name].stats()
            for counter in (
                "rows",
                "admitted",
                "evicted",
                "lookups",
                "pending_ids",
                "dropped_grads",
            ):
                assert together[counter] == own[counter], (name, counter)
        assert shard.store.tables["counting.weight"].stats()["pending_ids"] > 0
        assert shard.store.tables["expiring.weight"].stats()["evicted"] > 0
    finally:
        endpoint.coordinator.close()


class AdmittedAndExpiring(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(4, 1)
        self.emb = ps.DynamicEmbedding(4, mode="mean", init_scale=0.1, min_count=2, ttl_steps=4)

    def forward(self, bags: Tensor) -> Tensor:
        return self.out(self.emb(bags)).squeeze(1)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_the_single_process_reference_trains_dynamic_tables_as_servers_do(optimizer: str) -> None:
    """One trainer in sync mode applies each step's gradients before its next read, as the
    reference does: the same rows (admitted at the second sighting, expired after 4 idle
    steps), the same values."""
    config = ps.TrainConfig(
        servers=2, trainers=1, mode="sync", optimizer=optimizer, lr=0.1, launcher="threads",
        progress=False,
    )  # fmt: skip
    data = lambda t, n: hashed_batches(t, num_batches=30)  # noqa: E731
    result = ps.train(AdmittedAndExpiring, data, mse, config)
    assert result.model is not None
    reference, _ = train_single_process(AdmittedAndExpiring, data, mse, config)
    served, local = result.model.state_dict(), reference.state_dict()
    assert served.keys() == local.keys()
    assert 0 < served["emb.ids"].numel() < NUM_IDS  # some admitted, some pending or expired
    assert torch.equal(served["emb.ids"], local["emb.ids"])
    for name, value in served.items():
        torch.testing.assert_close(local[name], value, rtol=1e-5, atol=1e-6, msg=name)
    stats = result.summary["tables"]["emb.weight"]
    assert stats["evicted"] > 0 and stats["admitted"] > stats["rows"]
