"""Placement of dense parameters and routing of rows."""

from __future__ import annotations

import torch

from paramserver.sharding import DenseSpec, ShardPlan, TableSpec


def test_dense_parameters_are_balanced_by_bytes() -> None:
    sizes = [1000, 900, 500, 400, 300, 300, 100, 10]
    dense = [DenseSpec(f"p{i}", (n,), torch.float32) for i, n in enumerate(sizes)]
    plan = ShardPlan(dense, [], num_servers=3)
    load = [0, 0, 0]
    for name, server in plan.dense_server.items():
        load[server] += plan.dense[name].nbytes
    assert sum(load) == sum(sizes) * 4
    assert max(load) - min(load) <= max(sizes) * 4
    assert len(set(plan.dense_server.values())) == 3


def test_rows_route_cyclically_and_round_trip() -> None:
    plan = ShardPlan([], [TableSpec("t", 10, 2, torch.float32)], num_servers=3)
    ids = torch.arange(10)
    assert plan.server_of_rows("t", ids).tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    for server in range(3):
        mine = ids[plan.server_of_rows("t", ids) == server]
        assert torch.equal(plan.local_rows(mine) * 3 + server, mine)


def test_split_by_server_groups_ids_stably() -> None:
    plan = ShardPlan([], [TableSpec("t", 10, 2, torch.float32)], num_servers=2)
    ids = torch.tensor([5, 2, 7, 4, 1])
    order, counts = plan.split_by_server("t", ids)
    assert ids[order].tolist() == [2, 4, 5, 7, 1]
    assert counts == [2, 3]


def test_fingerprint_depends_on_structure_and_server_count() -> None:
    table = TableSpec("t", 10, 2, torch.float32)
    a = ShardPlan([], [table], num_servers=2).fingerprint
    assert a == ShardPlan([], [table], num_servers=2).fingerprint
    assert a != ShardPlan([], [table], num_servers=3).fingerprint
    assert a != ShardPlan([], [TableSpec("t", 11, 2, torch.float32)], 2).fingerprint
