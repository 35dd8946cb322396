"""Sync mode with 3 trainers and 2 servers equals single-process training on the global batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

import paramserver as ps
from paramserver.modelplan import initial_model
from tests.helpers import TinyRecModel, mse, tiny_batches

NUM_TRAINERS = 3
NUM_STEPS = 20
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "adam": (torch.optim.Adam, {"lr": 0.02}),
}


def single_process_reference(name: str) -> dict[str, torch.Tensor]:
    """Plain torch.optim on the concatenated global batch. Each table row is its own
    Parameter whose grad is None when the batch does not touch it, so torch.optim skips it:
    the lazy per-row semantics a parameter server has (per-row Adam step counts included)."""
    model = initial_model(TinyRecModel, seed=0)
    tables = {"user.weight": model.user.weight, "items.weight": model.items.weight}
    rows = {
        t: [nn.Parameter(w.detach()[i].clone()) for i in range(w.shape[0])]
        for t, w in tables.items()
    }
    dense = [p for n, p in model.named_parameters() if n not in tables]
    optimizer_class, kwargs = OPTIMIZERS[name]
    optimizer = optimizer_class(dense + [r for rs in rows.values() for r in rs], **kwargs)
    streams = [tiny_batches(t) for t in range(NUM_TRAINERS)]
    for _ in range(NUM_STEPS):
        batches = [next(s) for s in streams]
        inputs = tuple(torch.cat([b[0][i] for b in batches]) for i in range(3))
        target = torch.cat([b[1] for b in batches])
        optimizer.zero_grad(set_to_none=True)
        weights = {t: torch.stack(rs) for t, rs in rows.items()}
        mse(functional_call(model, weights, inputs), target).backward()
        touched = {"user.weight": inputs[0], "items.weight": inputs[1]}
        for table, ids in touched.items():
            keep = set(ids.unique().tolist())
            for i, row in enumerate(rows[table]):
                if i not in keep:
                    row.grad = None
        optimizer.step()
    state = {n: p.detach().clone() for n, p in model.named_parameters() if n not in tables}
    state.update({t: torch.stack([r.detach() for r in rs]) for t, rs in rows.items()})
    return state


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
