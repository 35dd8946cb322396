"""The row path does each transformation once: a pull's routing serves the push of its rows'
gradients (the result is what routing them again gives); a server decodes a request's gradients
in one step, and nothing after it decodes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from paramserver.compression import encode
from paramserver.protocol import PushPullRequest, RowBlock
from paramserver.trainer.client import PSClient
from paramserver.transport.local import LocalTransport
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
    after = client.push_pull({}, {TABLE: (pulled_ids, grads)}, {TABLE: ids}, grads_step=0).wait()
    assert routed == [5, 5]
    assert torch.equal(after.rows[TABLE][1], before - grads)  # sgd, lr 1: every row on its own
    # Equal ids in another tensor (as when rows were added since the pull): routed again.
    again = client.push_pull({}, {TABLE: (ids.clone(), grads)}, {TABLE: ids}, grads_step=1).wait()
    assert routed == [5, 5, 5, 5]
    assert torch.equal(again.rows[TABLE][1], after.rows[TABLE][1] - grads)


def test_gradients_are_decoded_once_where_they_are_checked(make_server: MakeServer) -> None:
    endpoint = make_server(0, servers=1, trainers=1)
    shard = endpoint.shard
    ids = torch.tensor([0, 3])
    grads = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    before = shard.export_state()[TABLE]["value"][ids]
    request = PushPullRequest(0, 0, row_grads={TABLE: RowBlock(ids, encode("fp16", grads))})
    shard.decode_request(request)
    assert type(request.row_grads[TABLE].values) is torch.Tensor
    shard.apply({}, request.row_grads)
    assert torch.equal(shard.export_state()[TABLE]["value"][ids], before - grads)  # sgd, lr 1
    # Past that step nothing decodes: an encoded gradient there is a bug, not a peer's error.
    with pytest.raises(TypeError, match="past decoding"):
        shard.apply({}, {TABLE: RowBlock(ids, encode("fp16", grads))})
