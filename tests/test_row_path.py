"""The row path does each transformation once: a pull's routing serves the push of its rows'
gradients, and the result is what routing them again gives."""

from __future__ import annotations

from typing import Any

import pytest
import torch

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
