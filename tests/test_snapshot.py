"""Shard snapshots: every value and optimizer state comes back exactly, on any server count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paramserver as ps
from paramserver.checkpoint import gather_saved
from paramserver.launch.roles import build_server
from paramserver.store.snapshot import restore_store, snapshot_store
from paramserver.trainer.client import gather_state
from paramserver.transport.local import LocalTransport
from tests.helpers import HashedModel, TinyRecModel, hashed_batches, mse, threads_job, tiny_batches


def trained(model_fn: type[nn.Module], data, servers: int, **options: object):  # type: ignore[no-untyped-def]
    config = ps.TrainConfig(
        servers=servers, trainers=2, optimizer="adam", lr=0.01, launcher="threads",
        progress=False, **options,
    )  # type: ignore[arg-type]  # fmt: skip
    _, transport = threads_job(config, model_fn, data, mse)
    return config, transport


@pytest.mark.parametrize(
    ("model_fn", "data"), [(TinyRecModel, tiny_batches), (HashedModel, hashed_batches)]
)
@pytest.mark.parametrize("new_servers", [2, 3, 1])
def test_a_snapshot_restores_every_value_and_state_on_any_server_count(
    model_fn: type[nn.Module], data: object, new_servers: int
) -> None:
    if model_fn is HashedModel:
        model_fn = lambda: HashedModel(dynamic=True)  # type: ignore[assignment]  # noqa: E731
    config, transport = trained(model_fn, lambda t, n: data(t), servers=2)  # type: ignore[operator]
    plan = transport.endpoints[0].shard.plan
    before = gather_state(transport, plan, with_optimizer=True)
    saved = [snapshot_store(e.shard.store) for e in transport.endpoints]

    new_config = config.replace(servers=new_servers)
    fresh = [build_server(s, new_config, model_fn) for s in range(new_servers)]
    for endpoint in fresh:
        restore_store(endpoint.shard.store, saved)
    after = gather_state(LocalTransport(fresh), fresh[0].shard.plan, with_optimizer=True)
    assert before.keys() == after.keys()
    for name, entry in before.items():
        assert entry.keys() == after[name].keys(), name
        for key, value in entry.items():
            assert torch.equal(value, after[name][key]), (name, key)
    state = gather_saved(saved)
    for name, entry in before.items():
        assert torch.equal(state[name], entry["value"]), name
