"""The trainer's hot-row cache: exact bookkeeping, a bounded lag, fewer bytes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import paramserver as ps
from paramserver.errors import InvalidPushError
from paramserver.trainer.cache import RowCache
from paramserver.wire.caching import must_send
from paramserver.wire.messages import PushPullRequest, RowBlock
from tests.helpers import MakeServer, TinyRecModel, mse, own_ids, tiny_batches


def test_row_cache_keeps_versions_and_evicts_least_recently_used() -> None:
    cache = RowCache(capacity=3, dim=2, dtype=torch.float32)

    def versions(*ids: int) -> list[int]:
        return cache.lookup(torch.tensor(ids))[1].tolist()

    def update(ids: list[int], rows: torch.Tensor, new: list[int], sent: list[bool]) -> None:
        slots, _ = cache.lookup(torch.tensor(ids))
        cache.update(torch.tensor(ids), slots, rows, torch.tensor(new), torch.tensor(sent))

    assert versions(5, 7, 9) == [-1, -1, -1]
    rows = torch.arange(6.0).view(3, 2)
    update([5, 7, 9], rows, [0, 4, -1], [True, True, True])
    assert versions(5, 7, 9) == [0, 4, -1]  # an id without a row is not kept
    assert torch.equal(cache.rows_at(cache.lookup(torch.tensor([7]))[0]), rows[1:2])
    # 5 is used (a hit), 11 and 13 arrive: 4 rows exceed capacity 3, so the least recently
    # used go down to 90% of it (2 rows): 7, then 5 (ties go by id).
    update([5, 11, 13], torch.ones(3, 2), [0, 1, 2], [False, True, True])
    assert versions(5, 7, 11, 13) == [-1, -1, 1, 2]
    assert (cache.hits, cache.lookups) == (1, 6)
    # A cached row that vanished from its server leaves the cache.
    update([11], torch.zeros(1, 2), [-1], [True])
    assert versions(11, 13) == [-1, 2]


def test_must_send_stale_uncached_and_missing_rows_only() -> None:
    cached = torch.tensor([-1, 3, 3, 3, 5])
    current = torch.tensor([0, 3, 5, 6, -1])
    assert must_send(cached, current, 2).tolist() == [True, False, False, True, True]


def test_a_server_sends_only_rows_the_cache_cannot_serve_and_checks_the_versions(
    make_server: MakeServer,
) -> None:
    server = make_server(mode="async", cache_rows=10, cache_lag=1)
    ids = own_ids(server, 0, 1, 2)
    grads = {"user.weight": RowBlock(ids[:1], torch.ones(1, 4))}
    for step in range(2):  # row 0 gets an update at step 1, another with the pull at step 2
        request = PushPullRequest(0, step, row_grads=grads if step else {})
        server.coordinator.push_pull(request).wait()
    request = PushPullRequest(0, 2, row_grads=grads, pull_rows={"user.weight": ids})
    request.pull_versions["user.weight"] = torch.tensor([0, 0, -1])
    reply = server.coordinator.push_pull(request).wait()
    assert reply.row_versions["user.weight"].tolist() == [2, 0, 0]
    assert reply.rows["user.weight"].shape == (2, 4)  # row 0 (2 behind) and row 2 (uncached)
    bad = PushPullRequest(0, 3, pull_rows={"user.weight": ids})
    bad.pull_versions["user.weight"] = torch.tensor([0, -2, 0])
    with pytest.raises(InvalidPushError, match="cached versions"):
        server.coordinator.push_pull(bad).wait()


def skewed(trainer: int, num_trainers: int) -> Iterator[Any]:
    """Tiny batches whose ids repeat a lot, as hot ids do."""
    for (user, items, dense), target in tiny_batches(trainer, num_batches=30, batch=8):
        yield (user % 6, items % 5, dense), target


def run(**options: object) -> ps.TrainResult:
    config = ps.TrainConfig(
        servers=1, trainers=1, optimizer="sgd", lr=0.05, launcher="threads", progress=False,
        prefetch=False, **options,
    )  # type: ignore[arg-type]  # fmt: skip
    return ps.train(TinyRecModel, skewed, mse, config)


def test_a_cache_with_no_lag_changes_nothing_and_a_bound_saves_bytes() -> None:
    plain = run()
    exact = run(cache_rows=100, cache_lag=0)
    assert exact.summary["cache"]["hit_rate"] == 0.0  # every used row was updated since
    for name, value in plain.model.state_dict().items():
        assert torch.equal(value, exact.model.state_dict()[name]), name
    bounded = run(cache_rows=100, cache_lag=4)
    assert bounded.summary["cache"]["hit_rate"] > 0.5
    assert bounded.summary["row_bytes_per_step"] < 0.6 * plain.summary["row_bytes_per_step"]
    assert abs(bounded.summary["train_loss"] - plain.summary["train_loss"]) < 0.1


def test_the_cache_needs_a_mode_that_allows_stale_reads() -> None:
    with pytest.raises(ps.ConfigError, match="--cache-rows"):
        ps.TrainConfig(mode="sync", cache_rows=10)
