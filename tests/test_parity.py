"""Sync mode with 3 trainers and 2 servers equals single-process training on the global batch."""

from __future__ import annotations

import pytest
import torch

import paramserver as ps
from paramserver.modelplan import initial_model
from tests.helpers import PARITY_OPTIMIZERS, TinyRecModel, mse, tiny_batches, tiny_single_process

NUM_TRAINERS = 3
NUM_STEPS = 20
OPTIMIZERS = PARITY_OPTIMIZERS


def single_process_reference(name: str) -> dict[str, torch.Tensor]:
    optimizer_class, kwargs = OPTIMIZERS[name]
    return tiny_single_process((optimizer_class, kwargs), NUM_TRAINERS, NUM_STEPS)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_sync_equals_single_process(optimizer: str) -> None:
    _, kwargs = OPTIMIZERS[optimizer]
    config = ps.TrainConfig(
        servers=2,
        trainers=NUM_TRAINERS,
        mode="sync",
        optimizer=optimizer,
        lr=kwargs["lr"],
        momentum=kwargs.get("momentum", 0.0),
        launcher="threads",
        progress=False,
    )
    result = ps.train(TinyRecModel, lambda t, n: tiny_batches(t), mse, config)
    assert result is not None
    assert result.summary["trainer_steps"] == [NUM_STEPS] * NUM_TRAINERS
    expected = single_process_reference(optimizer)
    got = result.model.state_dict()
    assert set(got) == set(expected)
    initial = initial_model(TinyRecModel, seed=0).state_dict()
    for name, value in expected.items():
        assert not torch.equal(value, initial[name]), f"{name} never moved: the test is vacuous"
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
