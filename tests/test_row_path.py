"""The row path does each transformation once: a pull's routing serves the push of its rows'
gradients (the result is what routing them again gives); a server decodes a request's gradients
in one step, and nothing after it decodes; which rows a trainer's cache serves is decided by the
server alone."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

from paramserver.server.decoded import DecodedRequest
from paramserver.server.rounds import aggregate_mean
from paramserver.trainer.client import PSClient
from paramserver.transport.local import LocalTransport
from paramserver.wire.caching import must_send, rows_sent
from paramserver.wire.compression import encode
from paramserver.wire.messages import BagBlock, PooledGrad, PushPullRequest, RowBlock
from tests.helpers import MakeServer

TABLE = "user.weight"


def two_servers(make_server: MakeServer) -> tuple[LocalTransport, Any]:
    endpoints = [make_server(server, servers=2, trainers=1) for server in range(2)]
    return LocalTransport(endpoints), endpoints[0].shard.plan


def test_the_push_of_pulled_rows_reuses_the_pulls_routing(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    transport, plan = two_servers(make_server)
    routed: list[int] = []
    split = plan.split_by_server

    def counted(table: str, ids: torch.Tensor) -> Any:
        routed.append(ids.numel())
        return split(table, ids)

    monkeypatch.setattr(plan, "split_by_server", counted)
    client = PSClient(transport, plan, trainer=0)
    ids = torch.tensor([1, 2, 5, 8, 13])
    pulled = client.push_pull({}, {}, {TABLE: ids}).wait()
    before = pulled.rows[TABLE][1]
    grads = torch.arange(10.0).view(5, 2).repeat(1, 2)
    pulled_ids = pulled.rows[TABLE][0]
    # The answer's ids (the tensor that was pulled): routed once, for the pull alone.
    after = client.push_pull({}, {TABLE: (pulled_ids, grads)}, {TABLE: ids}, grads_call=0).wait()
    assert routed == [5, 5]
    assert torch.equal(after.rows[TABLE][1], before - grads)  # sgd, lr 1: every row on its own
    # Equal ids in another tensor (as when rows were added since the pull): routed again.
    again = client.push_pull({}, {TABLE: (ids.clone(), grads)}, {TABLE: ids}, grads_call=1).wait()
    assert routed == [5, 5, 5, 5]
    assert torch.equal(again.rows[TABLE][1], after.rows[TABLE][1] - grads)


def test_gradients_are_decoded_once_where_they_are_checked(make_server: MakeServer) -> None:
    endpoint = make_server(0, servers=1, trainers=1)
    shard = endpoint.shard
    ids = torch.tensor([0, 3])
    grads = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    before = shard.store.export_state()[TABLE]["value"][ids]
    request = PushPullRequest(0, 0, row_grads={TABLE: RowBlock(ids, encode("fp16", grads))})
    shard.checks.decode_request(request)
    decoded = DecodedRequest.of(request)
    assert type(decoded.row_grads[TABLE].values) is torch.Tensor
    shard.apply({}, decoded.row_grads)
    assert torch.equal(shard.store.export_state()[TABLE]["value"][ids], before - grads)  # sgd, lr 1
    # Past that step nothing decodes: a request still encoded there is a bug, not a peer's error.
    undecoded = PushPullRequest(0, 1, row_grads={TABLE: RowBlock(ids, encode("fp16", grads))})
    with pytest.raises(TypeError, match="past decoding"):
        DecodedRequest.of(undecoded)


def test_a_pooled_pulls_distinct_ids_serve_its_gradients_push(
    make_server: MakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = make_server(0, servers=1, trainers=1, server_pooling=("items.weight",))
    coordinator = endpoint.coordinator
    uniques = []
    unique = torch.unique

    def counted(ids: torch.Tensor, **options: Any) -> Any:
        uniques.append(ids.tolist())
        return unique(ids, **options)

    monkeypatch.setattr(torch, "unique", counted)
    bags = BagBlock(torch.tensor([5, 2, 2, 1]), torch.tensor([0, 0, 1, 1]), num_bags=2)
    pull = PushPullRequest(0, 0, pull_dense=False, pool_rows={"items.weight": bags})
    rows = coordinator.shard.store.export_state()["items.weight"]["value"]
    pooled = coordinator.push_pull(pull).wait().pooled["items.weight"]
    assert torch.equal(pooled, torch.stack([rows[5] + rows[2], rows[2] + rows[1]]))
    grads = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]])
    push = PushPullRequest(0, 1, pooled_grads={"items.weight": PooledGrad(0, grads)}, grads_call=0)
    coordinator.push_pull(push).wait()
    assert uniques == [[5, 2, 2, 1]]  # once, at the pull
    after = coordinator.shard.store.export_state()["items.weight"]["value"]
    summed = torch.stack([grads[1], grads[0] + grads[1], grads[0]])  # rows 1, 2, 5's bags
    assert torch.equal(after[[1, 2, 5]], rows[[1, 2, 5]] - summed)  # sgd, lr 1


def test_distinct_ids_are_never_sent_and_a_peers_are_dropped() -> None:
    bags = BagBlock(torch.tensor([3, 1, 3]), torch.tensor([0, 0, 0]), num_bags=1)
    assert [t.tolist() for t in bags.distinct] == [[1, 3], [1, 0, 1]]
    assert "distinct" not in pickle.loads(pickle.dumps(bags)).__dict__
    # A peer's pickle may carry a state of its choosing; unpickling hands it to __setstate__.
    received = BagBlock.__new__(BagBlock)
    forged = (torch.tensor([99]), torch.tensor([0]))
    received.__setstate__({**pickle.loads(pickle.dumps(bags)).__dict__, "distinct": forged})
    assert received.distinct[0].tolist() == [1, 3]


def test_a_rounds_mean_of_one_push_is_bitwise_the_summed_mean() -> None:
    ids = torch.tensor([0, 2, 7])
    values = torch.tensor([[-0.0, 1.0], [3.0, -0.0], [0.1, -2.5]])
    requests = [
        PushPullRequest(0, 1, row_grads={TABLE: RowBlock(ids, values)}),
        PushPullRequest(1, 1),
    ]
    _, rows = aggregate_mean(requests)
    summed = torch.zeros(3, 2).index_add_(0, torch.arange(3), values).div_(2)
    assert torch.equal(rows[TABLE].ids, ids)
    assert rows[TABLE].values.numpy().tobytes() == summed.numpy().tobytes()  # +0.0, not -0.0


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_the_trainer_reads_which_rows_came_off_the_versions_the_server_decided_on(
    bound: int,
) -> None:
    g = torch.Generator().manual_seed(bound)
    cached = torch.randint(-1, 8, (2000,), generator=g)
    current = torch.randint(-1, 12, (2000,), generator=g)
    chosen = must_send(cached, current, bound)  # the server's decision, made there alone
    held = torch.where(chosen, current, cached)  # the answer's row_versions
    assert torch.equal(rows_sent(cached, held), chosen)
    assert 0 < int(chosen.sum()) < chosen.numel()
