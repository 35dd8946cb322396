"""Server-side pooling: the same training as trainer-side pooling, with less traffic."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import paramserver as ps
from paramserver.baseline import make_optimizers
from paramserver.modelplan import initial_model
from tests.helpers import mse

ROWS = 300


class BagModel(nn.Module):
    def __init__(self, mode: str, dynamic: bool) -> None:
        super().__init__()
        self.out = nn.Linear(8, 1)
        if dynamic:
            self.bag: nn.Module = ps.DynamicEmbedding(8, mode=mode, init_scale=0.2)
        else:
            self.bag = nn.EmbeddingBag(ROWS, 8, mode=mode)

    def forward(self, ids: Tensor, offsets: Tensor, weights: Tensor | None = None) -> Tensor:
        return self.out(self.bag(ids, offsets, per_sample_weights=weights)).squeeze(1)


def long_bags(trainer: int, weighted: bool, num_batches: int = 6) -> Iterator[Any]:
    g = torch.Generator().manual_seed(trainer)
    for _ in range(num_batches):
        lengths = torch.randint(20, 30, (16,), generator=g)
        lengths[3] = 0  # an empty bag
        ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
        inputs: tuple[Tensor, ...] = (ids, offsets)
        if weighted:
            inputs += (torch.rand(ids.numel(), generator=g),)
        yield inputs, torch.randn(16, generator=g)


@pytest.mark.parametrize(
    ("mode", "dynamic", "weighted"),
    [("sum", False, False), ("mean", False, False), ("sum", False, True), ("mean", True, False)],
)
def test_server_pooling_trains_like_trainer_pooling(
    mode: str, dynamic: bool, weighted: bool
) -> None:
    config = ps.TrainConfig(
        servers=2,
        trainers=2,
        mode="sync",
        optimizer="adagrad",
        lr=0.1,
        launcher="threads",
        progress=False,
    )
    data = lambda t, n: long_bags(t, weighted)  # noqa: E731
    model_fn = lambda: BagModel(mode, dynamic)  # noqa: E731
    on_trainers = ps.train(model_fn, data, mse, config)
    on_servers = ps.train(model_fn, data, mse, config.replace(server_pooling=("bag.weight",)))
    assert on_trainers is not None and on_servers is not None
    expected = on_trainers.model.state_dict()
    for name, value in on_servers.model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-5, msg=name)
    pulled = on_servers.summary["bytes"]["trainers"]["received"]
    assert pulled < 0.5 * on_trainers.summary["bytes"]["trainers"]["received"]


def one_update_behind(
    model_fn: Callable[[], BagModel], batches: Iterator[Any], config: ps.TrainConfig
) -> nn.Module:
    """One process's training in which each step reads the bag table as it was before the
    previous step's update, and every other parameter as it is."""
    model = initial_model(model_fn, config.seed)
    model.train()
    optimizers = make_optimizers(model, config)
    table = model.bag.weight
    read = table.detach().clone()
    for inputs, target in batches:
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        current = table.detach().clone()
        with torch.no_grad():
            table.copy_(read)
        mse(model(*inputs), target).backward()
        with torch.no_grad():
            table.copy_(current)
        for optimizer in optimizers:
            optimizer.step()
        read = current
    return model


@pytest.mark.parametrize(("mode", "weighted"), [("mean", False), ("sum", True)])
def test_server_pooling_runs_async_with_prefetch(mode: str, weighted: bool) -> None:
    # Prefetch pulls step t+1's pooled sums while step t computes, and the trainer applies
    # its own step-t update only to rows it holds: a pooled table is read one update behind
    # (README, "A step"), the dense layer exactly as one process reads it. With one trainer,
    # async is deterministic, so that is the model the job must return, tensor by tensor.
    config = ps.TrainConfig(
        servers=3,
        trainers=1,
        mode="async",
        optimizer="adagrad",
        lr=0.1,
        launcher="threads",
        progress=False,
        server_pooling=("bag.weight",),
    )
    assert config.prefetch and config.prefetch_own_updates
    model_fn = lambda: BagModel(mode, False)  # noqa: E731
    result = ps.train(model_fn, lambda t, n: long_bags(t, weighted), mse, config)
    assert result is not None and result.summary["trainer_steps"] == [6]
    expected = one_update_behind(model_fn, long_bags(0, weighted), config).state_dict()
    for name, value in result.model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-5, msg=name)


def test_server_pooling_rejects_what_it_cannot_pool() -> None:
    # Refused before the job starts, naming the flag and the table.
    with pytest.raises(ps.ConfigError, match="--server-pooling bag.weight: .*only sum and mean"):
        ps.train(
            lambda: BagModel("max", False),
            lambda t, n: long_bags(t, False),
            mse,
            ps.TrainConfig(launcher="threads", progress=False, server_pooling=("bag.weight",)),
        )
    with pytest.raises(ps.ConfigError, match="--accumulate 1"):
        ps.TrainConfig(server_pooling=("bag.weight",), accumulate=2)


class ModeDependentIds(BagModel):
    def forward(self, ids: Tensor, offsets: Tensor, weights: Tensor | None = None) -> Tensor:
        if self.training:  # a model whose lookups differ between train and eval mode
            ids = (ids + 1) % ROWS
        return super().forward(ids, offsets, weights)


def test_server_pooling_refuses_lookups_that_differ_from_the_record_pass() -> None:
    config = ps.TrainConfig(launcher="threads", progress=False, server_pooling=("bag.weight",))
    with pytest.raises(ps.JobFailedError, match="other ids than its record pass"):
        ps.train(
            lambda: ModeDependentIds("sum", False), lambda t, n: long_bags(t, False), mse, config
        )
