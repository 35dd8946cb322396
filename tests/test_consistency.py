"""SSP bounds, gradient staleness, stragglers, departures and heartbeats."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.futures import Future

import paramserver as ps
from paramserver.errors import ServerLostError, TrainerDepartedError
from paramserver.futures import completed, wait_all
from paramserver.server.endpoint import ServerEndpoint
from paramserver.trainer.heartbeat import Heartbeats
from paramserver.wire.messages import PushPullRequest, RowBlock
from tests.helpers import MakeServer, TinyRecModel, mse, own_ids, tiny_batches


def push(endpoint: ServerEndpoint, trainer: int, step: int, **fields: Any) -> Future:
    request = PushPullRequest(trainer, step, **fields)
    return endpoint.coordinator.push_pull(request)


def row_grad(endpoint: ServerEndpoint) -> dict[str, RowBlock]:
    return {"user.weight": RowBlock(own_ids(endpoint, 0), torch.ones(1, 4))}


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_ssp_holds_a_trainer_exactly_while_it_is_more_than_s_ahead(
    bound: int, make_server: MakeServer
) -> None:
    server = make_server(mode="ssp", ssp_bound=bound, prefetch=False)
    slow_start = push(server, 1, 0)  # with s = 0 even call 0 waits for every trainer's
    assert slow_start.done() == (bound > 0)
    calls = [push(server, 0, c) for c in range(bound + 3)]  # trainer 1 stays at call 0
    assert slow_start.done()
    # Call c is answered only once the slowest trainer has made call c - s.
    assert [f.done() for f in calls] == [c <= bound for c in range(bound + 3)]
    assert server.coordinator.liveness_stats()["held_answers"] == 2 + (bound == 0)
    push(server, 1, 1).wait()
    assert [f.done() for f in calls] == [c <= bound + 1 for c in range(bound + 3)]
    push(server, 1, 2).wait()
    assert all(f.done() for f in calls)
    assert server.coordinator.liveness_stats()["released_at_deadline"] == 0


def test_ssp_with_prefetch_spends_one_step_of_the_bound(make_server: MakeServer) -> None:
    server = make_server(mode="ssp", ssp_bound=2)  # prefetch on by default
    push(server, 1, 0).wait()
    assert [push(server, 0, c).done() for c in range(4)] == [True, True, False, False]
    with pytest.raises(ps.ConfigError):
        ps.TrainConfig(min_contributors=3, trainers=2)
    assert not ps.TrainConfig(mode="ssp", ssp_bound=0).prefetches


def test_ssp_releases_a_held_answer_when_the_slow_trainer_departs_or_at_the_deadline(
    make_server: MakeServer,
) -> None:
    server = make_server(
        mode="ssp", ssp_bound=0, prefetch=False, trainer_timeout=2.0, watchdog=False
    )
    starts = [push(server, 0, 0), push(server, 1, 0)]
    assert all(f.done() for f in starts)
    held = push(server, 0, 1)
    assert not held.done()
    server.coordinator.check_liveness(time.monotonic() + 60)  # both silent: both depart
    assert held.done() and server.coordinator.liveness_stats()["departed"] == [0, 1]

    timed = make_server(mode="ssp", ssp_bound=0, prefetch=False, round_deadline=0.5, watchdog=False)
    starts = [push(timed, 0, 0), push(timed, 1, 0)]
    assert all(f.done() for f in starts)
    waiting = push(timed, 0, 1)
    timed.coordinator.check_liveness(time.monotonic() + 0.1)
    assert not waiting.done()
    timed.coordinator.check_liveness(time.monotonic() + 1.0)
    assert waiting.done()
    assert timed.coordinator.liveness_stats()["released_at_deadline"] == 1


def test_a_sync_round_closes_at_its_deadline_and_the_late_push_is_not_applied(
    make_server: MakeServer,
) -> None:
    server = make_server(mode="sync", round_deadline=0.5, min_contributors=1, watchdog=False)
    push(server, 0, 0).wait()
    push(server, 1, 0).wait()
    first = push(server, 0, 1, row_grads=row_grad(server))
    server.coordinator.check_liveness(time.monotonic() + 0.1)
    assert not first.done()  # before the deadline the round waits for trainer 1
    server.coordinator.check_liveness(time.monotonic() + 1.0)
    first.wait()
    before = server.shard.store.state_hash()
    late = push(server, 1, 1, row_grads=row_grad(server), grads_call=0)
    late.wait()  # answered at once with current values...
    assert server.shard.store.state_hash() == before  # ...and its gradients dropped
    stats = server.coordinator.liveness_stats()
    assert stats["short_rounds"] == 1 and stats["late_pushes"] == 1
    # Both are in step again: round 2 needs both.
    second = push(server, 0, 2)
    assert not second.done()
    push(server, 1, 2).wait()
    assert second.done()


def test_a_deadline_never_closes_a_round_below_min_contributors(make_server: MakeServer) -> None:
    server = make_server(
        mode="sync", trainers=3, round_deadline=0.5, min_contributors=2, watchdog=False
    )
    for t in range(3):
        push(server, t, 0).wait()
    first = push(server, 0, 1)
    server.coordinator.check_liveness(time.monotonic() + 5)
    assert not first.done()
    push(server, 1, 1)
    server.coordinator.check_liveness(time.monotonic() + 5)
    assert first.done()


def test_a_silent_trainer_departs_and_its_late_pushes_are_refused(make_server: MakeServer) -> None:
    server = make_server(mode="sync", trainer_timeout=2.0, watchdog=False)
    push(server, 0, 0).wait()
    push(server, 1, 0).wait()
    waiting = push(server, 0, 1)
    server.coordinator.heartbeat(0, 0.0)
    now = time.monotonic()
    server.coordinator.check_liveness(now + 1.0)
    assert not waiting.done()
    server.coordinator.liveness.last_seen[0] = now + 2.5  # trainer 0 keeps beating; 1 stays silent
    server.coordinator.check_liveness(now + 3.0)
    waiting.wait()  # the round closed without the departed trainer
    assert server.coordinator.liveness_stats()["departed"] == [1]
    assert server.coordinator.heartbeat(1, 0.0).wait().startswith("departed: silent")
    before = server.shard.store.state_hash()
    with pytest.raises(TrainerDepartedError, match="declared departed"):
        push(server, 1, 1, row_grads=row_grad(server), grads_call=0).wait()
    assert server.shard.store.state_hash() == before


def test_staleness_is_zero_in_sync_mode_and_counts_updates_in_between_in_async(
    make_server: MakeServer,
) -> None:
    for mode, expected in (("sync", {0: 2}), ("async", {0: 1, 1: 1})):
        server = make_server(mode=mode)
        push(server, 0, 0).wait()
        push(server, 1, 0).wait()
        a = push(server, 0, 1, row_grads=row_grad(server), grads_call=0)
        b = push(server, 1, 1, row_grads=row_grad(server), grads_call=0)
        a.wait()
        b.wait()
        assert server.coordinator.liveness_stats()["staleness"] == expected, mode


class _Unreachable:
    """A transport whose server 1 never answers and fails heartbeats at once."""

    num_servers = 2

    def __init__(self) -> None:
        self.never: Future = Future()

    def call(self, server: int, op: str, *args: Any, timeout_s: float | None = None) -> Future:
        future: Future = Future()
        if server == 1:
            future.set_exception(RuntimeError("connection refused"))
        else:
            future.set_result("member")
        return future


def test_a_lost_server_raises_the_alarm_and_ends_a_wait_at_once() -> None:
    transport = _Unreachable()
    beats = Heartbeats(transport, 0, interval=0.05, timeout_s=0.5).start()  # type: ignore[arg-type]
    started = time.monotonic()
    with pytest.raises(ServerLostError, match="server 1 did not answer a heartbeat") as caught:
        wait_all([transport.never], beats.alarm)
    assert time.monotonic() - started < 5
    assert caught.value.server == 1
    beats.stop()


def slow_data(delays: dict[int, float]) -> Any:
    def data(trainer: int, num_trainers: int) -> Iterator[Any]:
        for batch in tiny_batches(trainer, num_batches=12):
            time.sleep(delays.get(trainer, 0.0))
            yield batch

    return data


def test_ssp_job_keeps_the_bound_and_reports_staleness() -> None:
    config = ps.TrainConfig(
        servers=2, trainers=3, mode="ssp", ssp_bound=1, optimizer="sgd", lr=0.05,
        launcher="threads", progress=False,
    )  # fmt: skip
    result = ps.train(TinyRecModel, slow_data({2: 0.02}), mse, config)
    summary = result.summary
    assert summary["trainer_steps"] == [12, 12, 12]
    ages = summary["staleness"]
    # Every push of steps 1..12 of 3 trainers to 2 servers, minus the initial pulls' none.
    assert sum(ages.values()) == 2 * 3 * 12
    # A step's parameters can miss at most the bound's worth of others' steps, plus this step's.
    assert max(ages) <= (1 + 1 + 1) * 3
    assert any(s["held_answers"] for s in summary["server_stats"])


@pytest.mark.system
def test_sync_job_with_a_straggler_and_a_deadline_finishes_with_short_rounds() -> None:
    config = ps.TrainConfig(
        servers=1, trainers=2, mode="sync", round_deadline=0.05, optimizer="sgd", lr=0.05,
        launcher="threads", progress=False,
    )  # fmt: skip
    result = ps.train(TinyRecModel, slow_data({1: 0.2}), mse, config)
    server = result.summary["server_stats"][0]
    assert server["short_rounds"] > 0 and server["late_pushes"] > 0
    assert result.summary["trainer_steps"] == [12, 12]
    assert set(result.summary["staleness"]) == {0}


def test_a_wait_on_answers_already_in_returns_them_and_one_under_way_watches_the_alarm() -> None:
    """Answers already in are returned at once (a prefetched step's usually are), even beside
    an alarm gone off: they are whole. One still under way watches the alarm."""
    alarm: Future = Future()
    alarm.set_exception(ServerLostError("server 0 is gone", server=0))
    assert wait_all([completed(1), completed(2)], alarm) == [1, 2]
    with pytest.raises(ServerLostError, match="server 0 is gone"):
        wait_all([completed(1), Future()], alarm)
