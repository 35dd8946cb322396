"""Server shard and coordinator: bad input, concurrency, idempotency, sync rounds."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

import paramserver as ps
from paramserver.errors import InvalidPushError, ParamServerError, TrainerDepartedError
from paramserver.launch.roles import build_server
from paramserver.server.endpoint import ServerEndpoint
from paramserver.transport.local import LocalTransport
from paramserver.wire.messages import PushPullReply, PushPullRequest, RowBlock
from tests.field_models import BatchNormedFields
from tests.helpers import MakeServer, a_dense_name, new_server, own_ids


def bad_requests(endpoint: ServerEndpoint) -> dict[str, PushPullRequest]:
    """One request per class of bad input, each mixed with a valid part that must not apply."""
    dense = a_dense_name(endpoint)
    shape = endpoint.shard.store.dense[dense].value.shape
    good_rows = {"user.weight": RowBlock(own_ids(endpoint, 0, 1), torch.ones(2, 4))}

    def request(**fields: object) -> PushPullRequest:
        base: dict[str, object] = {"row_grads": dict(good_rows)}
        base.update(fields)
        return PushPullRequest(trainer=0, call=0, **base)  # type: ignore[arg-type]

    other_dense = next(
        n for n, s in endpoint.shard.plan.dense_server.items() if s != endpoint.shard.server
    )
    nan = torch.ones(shape)
    nan.view(-1)[0] = float("nan")
    inf = torch.ones(shape)
    inf.view(-1)[-1] = float("inf")
    return {
        "wrong shape": request(dense_grads={dense: torch.ones(*shape, 2)}),
        "wrong dtype": request(dense_grads={dense: torch.ones(shape, dtype=torch.float64)}),
        "unknown parameter": request(dense_grads={"no.such.weight": torch.ones(3)}),
        "parameter on another server": request(dense_grads={other_dense: torch.ones(1)}),
        "unknown table": request(
            row_grads={"no.such.table": RowBlock(own_ids(endpoint, 0), torch.ones(1, 4))}
        ),
        "row id out of range": request(
            row_grads={
                "user.weight": RowBlock(
                    torch.tensor([10_000 * 2 + endpoint.shard.server]), torch.ones(1, 4)
                )
            }
        ),
        "negative row id": request(
            row_grads={
                "user.weight": RowBlock(
                    torch.tensor([-2 + endpoint.shard.server]), torch.ones(1, 4)
                )
            }
        ),
        "row routed to another server": request(
            row_grads={"user.weight": RowBlock(own_ids(endpoint, 0) + 1, torch.ones(1, 4))}
        ),
        "duplicate row ids": request(
            row_grads={"user.weight": RowBlock(own_ids(endpoint, 3, 3), torch.ones(2, 4))}
        ),
        "row gradient shape": request(
            row_grads={"user.weight": RowBlock(own_ids(endpoint, 0, 1), torch.ones(2, 5))}
        ),
        "row gradient dtype": request(
            row_grads={
                "user.weight": RowBlock(
                    own_ids(endpoint, 0, 1), torch.ones(2, 4, dtype=torch.float16)
                )
            }
        ),
        "NaN": request(dense_grads={dense: nan}),
        "Inf": request(dense_grads={dense: inf}),
        "NaN in rows": request(
            row_grads={
                "user.weight": RowBlock(own_ids(endpoint, 0), torch.full((1, 4), float("nan")))
            }
        ),
        "ids not int64": request(
            row_grads={"user.weight": RowBlock(own_ids(endpoint, 0).int(), torch.ones(1, 4))}
        ),
        "pull out of range": request(pull_rows={"items.weight": torch.tensor([10**9])}),
        "not a tensor": request(dense_grads={dense: [1.0, 2.0]}),
        "tensor with autograd": request(dense_grads={dense: torch.ones(shape, requires_grad=True)}),
        "sparse tensor": request(dense_grads={dense: torch.ones(shape).to_sparse()}),
    }


def bad_request_names() -> list[str]:
    endpoint = new_server()
    try:
        return sorted(bad_requests(endpoint))
    finally:
        endpoint.coordinator.close()


@pytest.mark.parametrize("case", bad_request_names())
def test_bad_push_is_rejected_whole_and_changes_nothing(case: str, make_server: MakeServer) -> None:
    endpoint = make_server()
    request = bad_requests(endpoint)[case]
    before = endpoint.shard.store.state_hash()
    transport = LocalTransport([endpoint])
    with pytest.raises(InvalidPushError) as caught:
        transport.push_pull(0, request).wait()
    assert "server 0" in str(caught.value)
    assert endpoint.shard.store.state_hash() == before
    assert endpoint.shard.stats.pushes == 0
    # The server still works: the same trainer's valid push applies afterwards.
    good = PushPullRequest(
        trainer=0,
        call=0,
        row_grads={"user.weight": RowBlock(own_ids(endpoint, 0), torch.ones(1, 4))},
    )
    transport.push_pull(0, good).wait()
    assert endpoint.shard.store.state_hash() != before


def test_error_names_the_parameter(make_server: MakeServer) -> None:
    endpoint = make_server()
    dense = a_dense_name(endpoint)
    request = PushPullRequest(trainer=0, call=1, dense_grads={dense: torch.ones(99)})
    with pytest.raises(InvalidPushError, match=f"parameter '{dense}'.*shape"):
        endpoint.handle("push_pull", (request,)).wait()


def test_the_gradient_that_is_not_finite_is_named_among_many(
    make_server: MakeServer, loop_mode: str
) -> None:
    """A request's gradients are checked for NaN and Inf together: in one compiled pass, or
    one sum over all of them. Finite gradients whose sum overflows pass; a NaN or Inf in any
    one of several, laid out in order or not, is refused naming that one."""
    endpoint = make_server()
    dense = a_dense_name(endpoint)
    shape = endpoint.shard.store.dense[dense].value.shape
    huge = torch.full(shape, 3e38)  # finite, but sums to inf
    rows = {"user.weight": RowBlock(own_ids(endpoint, 0, 1), torch.full((2, 4), 3e38))}
    accepted = PushPullRequest(trainer=0, call=0, dense_grads={dense: huge}, row_grads=rows)
    endpoint.handle("push_pull", (accepted,)).wait()
    for bad, transposed in itertools.product((float("nan"), float("inf"), float("-inf")), (0, 1)):
        values = torch.ones(4, 2).t() if transposed else torch.ones(2, 4)
        values[1, 2] = bad
        rows = {"user.weight": RowBlock(own_ids(endpoint, 0, 1), values)}
        refused = PushPullRequest(trainer=0, call=1, dense_grads={dense: huge}, row_grads=rows)
        with pytest.raises(InvalidPushError, match="'user.weight'.*NaN or Inf"):
            endpoint.handle("push_pull", (refused,)).wait()


def test_ids_checked_together_pass_exactly_what_each_set_checked_alone_passes(
    make_server: MakeServer, loop_mode: str
) -> None:
    """A request's id sets are checked together (in one compiled call, or joined in a few
    array operations) and one at a time only where that finds a fault. Over random requests
    to server 0 of 2 (sets empty or not, unsorted, repeated, out of range, negative, routed to
    the other server, or below the set before them, which is valid), the joint check passes
    exactly what every set alone passes, and validation refuses exactly the others."""
    endpoint = make_server()
    checks = endpoint.shard.checks
    specs = endpoint.shard.plan.tables
    g = torch.Generator().manual_seed(0)

    def draw(rows: int) -> torch.Tensor:
        own = torch.randint(
            0, rows // 2, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g
        )
        ids = own.unique() * 2  # server 0's rows, sorted
        fault = int(torch.randint(0, 12, (1,), generator=g)) if ids.numel() else 0
        if fault == 1 and ids.numel() > 1:
            ids = ids.flip(0)
        elif fault == 2:
            ids[-1] = rows + rows % 2  # past the end, and even
        elif fault == 3:
            ids[0] = -2
        elif fault == 4:
            ids[0] += 1  # the other server's
        elif fault == 5:
            ids = torch.cat([ids, ids[-1:]])
        return ids

    outcomes = []
    for _ in range(400):
        pushed = {
            name: draw(spec.num_rows)
            for name, spec in specs.items()
            if torch.rand(1, generator=g) < 0.7
        }
        pulled = {
            name: draw(spec.num_rows)
            for name, spec in specs.items()
            if torch.rand(1, generator=g) < 0.7
        }
        row_grads = {
            n: RowBlock(ids, torch.zeros(ids.numel(), specs[n].dim)) for n, ids in pushed.items()
        }
        request = PushPullRequest(trainer=0, call=0, row_grads=row_grads, pull_rows=pulled)
        alone = True
        for name, ids in [*pushed.items(), *pulled.items()]:
            try:
                checks.ids.check(name, endpoint.shard.store.tables[name], ids, sorted_unique=True)
            except InvalidPushError:
                alone = False
        assert checks.ids.all_valid(request) == alone
        if alone:
            checks.validate(request)
        else:
            with pytest.raises(InvalidPushError, match="row id"):
                checks.validate(request)
        outcomes.append(alone)
    assert 50 < sum(outcomes) < 350  # both kinds were drawn often


def test_malformed_calls_are_refused(make_server: MakeServer) -> None:
    endpoint = make_server()
    before = endpoint.shard.store.state_hash()
    junk_report = PushPullRequest(trainer=0, call=1, report="junk")  # type: ignore[arg-type]
    cases = [
        ("drop_tables", ()),
        (7, ()),
        ("push_pull", "not a tuple"),
        ("push_pull", (42,)),
        ("push_pull", ()),
        ("push_pull", (PushPullRequest(trainer=7, call=1),)),
        ("push_pull", (PushPullRequest(trainer=True, call=1),)),
        ("push_pull", (PushPullRequest(trainer=0, call=-1),)),
        ("push_pull", (PushPullRequest(trainer=0, call=1.5),)),  # type: ignore[arg-type]
        ("push_pull", (PushPullRequest(trainer=0, call=1, final=1),)),  # type: ignore[arg-type]
        ("push_pull", (PushPullRequest(trainer=0, call=1, dense_grads=[]),)),  # type: ignore[arg-type]
        ("push_pull", (PushPullRequest(trainer=0, call=1, row_grads={1: None}),)),  # type: ignore[dict-item]
        ("push_pull", (junk_report,)),
        ("pull", (PushPullRequest(trainer=0, call=0, final=True),)),
        ("export_state", (1, 2, 3)),
        ("export_state", ("yes",)),
    ]
    for op, args in cases:
        with pytest.raises(ParamServerError):
            endpoint.handle(op, args).wait()
    assert endpoint.shard.store.state_hash() == before
    assert endpoint.coordinator.last_call == {}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"call": -1}, "bad call -1"),
        ({"call": "1"}, "bad call '1'"),
        ({"call": 1, "grads_call": 1}, "bad grads_call 1"),
        ({"call": 1, "grads_call": -2}, "bad grads_call -2"),
        ({"call": 1, "grads_call": None}, "bad grads_call None"),
    ],
)
def test_a_bad_call_number_is_refused_naming_its_field(
    make_server: MakeServer, fields: dict[str, object], message: str
) -> None:
    endpoint = make_server()
    request = PushPullRequest(trainer=0, **fields)  # type: ignore[arg-type]
    with pytest.raises(ParamServerError, match=message):
        endpoint.handle("push_pull", (request,)).wait()
    assert endpoint.coordinator.last_call == {}


def test_randomized_malformed_pushes_never_change_state(make_server: MakeServer) -> None:
    endpoint = make_server()
    before = endpoint.shard.store.state_hash()
    g = torch.Generator().manual_seed(0)
    dense = a_dense_name(endpoint)
    shape = endpoint.shard.store.dense[dense].value.shape
    rejected = 0
    for call in range(1, 301):
        garbage = torch.randn(shape, generator=g)
        garbage.view(-1)[int(torch.randint(0, garbage.numel(), (1,), generator=g))] = float("nan")
        ids = torch.randint(-50, 100, (3,), generator=g)
        rows = torch.randn(3, int(torch.randint(3, 6, (1,), generator=g)), generator=g)
        request = PushPullRequest(
            trainer=0,
            call=call,
            dense_grads={dense: garbage},
            row_grads={"user.weight": RowBlock(ids, rows)},
        )
        with pytest.raises(InvalidPushError):
            endpoint.handle("push_pull", (request,)).wait()
        rejected += 1
    assert rejected == 300
    assert endpoint.shard.store.state_hash() == before


def test_concurrent_async_pushes_to_the_same_rows_lose_nothing(make_server: MakeServer) -> None:
    endpoint = make_server(server=0, servers=1, trainers=8)
    ids = torch.tensor([0, 3, 5, 7], dtype=torch.int64)
    start = endpoint.shard.store.tables["user.weight"].weight[ids].clone()
    pushes_per_trainer = 50
    barrier = threading.Barrier(8)

    def pusher(trainer: int) -> None:
        barrier.wait()
        for call in range(pushes_per_trainer):
            grad = torch.full((4, 4), 0.001 * (trainer + 1))
            request = PushPullRequest(
                trainer=trainer,
                call=call,
                pull_dense=False,
                row_grads={"user.weight": RowBlock(ids, grad)},
            )
            endpoint.handle("push_pull", (request,)).wait()

    threads = [threading.Thread(target=pusher, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total = sum(0.001 * (t + 1) for t in range(8)) * pushes_per_trainer
    expected = start - total  # SGD, lr 1: every push subtracts its gradient
    torch.testing.assert_close(endpoint.shard.store.tables["user.weight"].weight[ids], expected)
    assert endpoint.shard.stats.pushes == 8 * pushes_per_trainer


def test_duplicate_push_is_answered_not_applied_twice(make_server: MakeServer) -> None:
    endpoint = make_server()
    ids = own_ids(endpoint, 2)
    request = PushPullRequest(
        trainer=1,
        call=0,
        row_grads={"user.weight": RowBlock(ids, torch.ones(1, 4))},
        pull_rows={"user.weight": ids},
    )
    first = endpoint.handle("push_pull", (request,)).wait()
    again = endpoint.handle("push_pull", (request,)).wait()
    assert endpoint.shard.stats.pushes == 1
    assert isinstance(again, PushPullReply)
    torch.testing.assert_close(first.rows["user.weight"], again.rows["user.weight"])


def start(endpoint: ServerEndpoint, trainers: int) -> None:
    """Each trainer's first call (number 0): the initial pull."""
    for trainer in range(trainers):
        request = PushPullRequest(trainer=trainer, call=0, pull_dense=False)
        endpoint.handle("push_pull", (request,)).wait()


def sync_push(
    endpoint: ServerEndpoint, trainer: int, call: int, value: float, final: bool = False
) -> torch.futures.Future:
    ids = own_ids(endpoint, 0)
    request = PushPullRequest(
        trainer=trainer,
        call=call,
        final=final,
        pull_dense=False,
        row_grads={"user.weight": RowBlock(ids, torch.full((1, 4), value))},
        pull_rows={"user.weight": ids},
    )
    return endpoint.handle("push_pull", (request,))


def test_sync_round_waits_for_every_trainer_then_applies_the_mean_once(
    make_server: MakeServer,
) -> None:
    endpoint = make_server(mode="sync", trainers=3)
    start(endpoint, 3)
    initial = endpoint.shard.store.tables["user.weight"].weight[0].clone()
    first = sync_push(endpoint, 0, 1, 1.0)
    second = sync_push(endpoint, 2, 1, 2.0)
    assert not first.done() and not second.done()
    assert endpoint.shard.stats.pushes == 0
    duplicate = sync_push(endpoint, 0, 1, 1.0)  # a retry while waiting joins the same answer
    third = sync_push(endpoint, 1, 1, 6.0)
    for future in (first, second, third, duplicate):
        torch.testing.assert_close(future.wait().rows["user.weight"][0], initial - 3.0)
    assert endpoint.shard.stats.pushes == 1


def test_sync_rounds_continue_without_a_trainer_that_left(make_server: MakeServer) -> None:
    endpoint = make_server(mode="sync", trainers=2)
    start(endpoint, 2)
    initial = endpoint.shard.store.tables["user.weight"].weight[0].clone()
    a = sync_push(endpoint, 0, 1, 1.0)
    b = sync_push(endpoint, 1, 1, 3.0, final=True)  # trainer 1's data ended
    torch.testing.assert_close(b.wait().rows["user.weight"][0], initial - 2.0)
    a.wait()
    # Round 2 has only trainer 0 and completes at once with its gradient alone.
    torch.testing.assert_close(
        sync_push(endpoint, 0, 2, 4.0).wait().rows["user.weight"][0], initial - 6.0
    )
    with pytest.raises(TrainerDepartedError):
        sync_push(endpoint, 1, 2, 1.0).wait()
    assert not endpoint.handle("wait_all_left", ()).done()
    sync_push(endpoint, 0, 3, 0.0, final=True).wait()
    assert endpoint.handle("wait_all_left", ()).done()


def test_a_trainer_leaving_without_gradients_completes_a_waiting_round(
    make_server: MakeServer,
) -> None:
    endpoint = make_server(mode="sync", trainers=2)
    start(endpoint, 1)  # trainer 1 has no data: its first call leaves
    waiting = sync_push(endpoint, 0, 1, 1.0)
    leave = PushPullRequest(trainer=1, call=0, final=True, pull_dense=False)
    endpoint.handle("push_pull", (leave,)).wait()
    waiting.wait()
    assert endpoint.shard.stats.pushes == 1


def test_a_call_number_gap_is_refused_and_moves_no_clock(make_server: MakeServer) -> None:
    endpoint = make_server()
    start(endpoint, 2)
    jump = PushPullRequest(trainer=1, call=10**6, pull_dense=False)
    with pytest.raises(ParamServerError, match="sent call 1000000 after 0"):
        endpoint.handle("push_pull", (jump,)).wait()
    assert endpoint.shard.store.clock == 0
    assert endpoint.coordinator.last_call == {0: 0, 1: 0}


def test_a_duplicate_is_still_validated_and_errors_come_back_as_futures(
    make_server: MakeServer,
) -> None:
    endpoint = make_server()
    start(endpoint, 1)
    stale = PushPullRequest(trainer=0, call=0, pull_rows={"no.such.table": torch.tensor([0])})
    future = endpoint.handle("push_pull", (stale,))  # must not raise here
    with pytest.raises(InvalidPushError, match="unknown parameter or table"):
        future.wait()
    repeated = PushPullRequest(
        trainer=0, call=1, pull_rows={"user.weight": own_ids(endpoint, 3, 3)}
    )
    with pytest.raises(InvalidPushError, match="sorted and unique"):
        endpoint.handle("push_pull", (repeated,)).wait()


def test_only_the_chiefs_buffers_of_the_models_shape_are_set_else_nothing_changes() -> None:
    config = ps.TrainConfig(servers=1, trainers=2, mode="async", optimizer="sgd", lr=1.0)
    endpoint = build_server(0, config, BatchNormedFields)
    try:
        store = endpoint.shard.store
        mean, var = "mlp.0.running_mean", "mlp.3.running_var"
        assert {mean, var} <= store.buffers
        value = torch.full((8,), 3.0)
        bad = {
            "not the chief's": (PushPullRequest(1, 0, buffers={mean: value}), "trainer 1"),
            "unknown": (PushPullRequest(0, 0, buffers={"mlp.9.running_mean": value}), "unknown"),
            "shape": (PushPullRequest(0, 0, buffers={mean: value, var: torch.ones(9)}), "9"),
            "dtype": (PushPullRequest(0, 0, buffers={mean: value.double()}), "float64"),
            "not a tensor": (PushPullRequest(0, 0, buffers={mean: [3.0] * 8}), "plain"),  # type: ignore[dict-item]
            "a gradient": (PushPullRequest(0, 0, dense_grads={mean: value}), "never by gradient"),
        }  # fmt: skip
        before = store.state_hash()
        transport = LocalTransport([endpoint])
        for case, (request, reason) in bad.items():
            refused = var if case == "shape" else mean if case != "unknown" else "mlp.9"
            with pytest.raises(InvalidPushError, match=f"'{refused}.*{reason}") as caught:
                transport.push_pull(0, request).wait()
            assert "server 0" in str(caught.value), case
            assert store.state_hash() == before, case
        transport.push_pull(0, PushPullRequest(0, 0, buffers={mean: value})).wait()
        assert torch.equal(store.export_state()[mean]["value"], value)
        assert torch.equal(endpoint.handle("initial_buffers", ()).wait()[mean], value)
        assert store.state_hash() != before
    finally:
        endpoint.coordinator.close()
