"""Several steps from one pull (``--steps-per-call``): the trainer applies its own updates
between them, and their pushes travel together (``push_pulls``) with the next pull."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import paramserver as ps
from paramserver.config import CALLS_PER_MESSAGE
from paramserver.errors import ConfigError, InvalidPushError, JobFailedError, ParamServerError
from paramserver.trainer.ownupdates import OwnUpdates
from paramserver.wire.messages import PushPullReply, PushPullRequest, RowBlock
from tests.factorization import NUM_STEPS, RULES, Factorization, batches, train
from tests.helpers import (
    MakeServer,
    TwoTaskModel,
    own_ids,
    two_task_batches,
    two_task_loss,
    wait_for_checkpoint,
)


def state_of(result: ps.TrainResult | None) -> dict[str, Tensor]:
    assert result is not None and result.model is not None
    return result.model.state_dict()


def assert_same(got: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("rule", sorted(RULES))
def test_steps_from_one_pull_learn_as_steps_that_pull_each(rule: str) -> None:
    """One trainer: each step of a group reads bitwise the rows and dense values it would
    have pulled alone (12 steps in groups of 5: a short last group too)."""
    alone = train(rule, prefetch=False)
    assert_same(train(rule, steps_per_call=5), alone)


def test_without_its_own_updates_a_group_would_learn_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The test above can fail: steps that read the pull without the group's earlier
    updates end elsewhere."""
    alone = train("adam", prefetch=False)
    monkeypatch.setattr(OwnUpdates, "apply", lambda *args, **kwargs: None)
    stale = train("adam", steps_per_call=4)
    assert any(not torch.equal(stale[name], value) for name, value in alone.items())


def test_the_schedule_counts_every_step_of_a_group() -> None:
    """Each push carries its own step for the lr schedule, not its pull's call."""
    options = {"prefetch": False, "lr_warmup_steps": 5, "lr_decay": "cosine", "lr_decay_steps": 12}
    alone = train("momentum", **options)
    assert_same(train("momentum", **{**options, "steps_per_call": 4}), alone)


def test_a_group_sends_one_message_per_server_for_its_steps() -> None:
    """12 steps in groups of 4, 2 servers: the first pull alone, then per group one message
    of 4 calls to each server (the last group's, with the final call, is not profiled)."""
    config = ps.TrainConfig(
        servers=2, trainers=1, mode="async", launcher="threads", progress=False,
        optimizer="sgd", lr=0.1, steps_per_call=4,
    )  # fmt: skip
    result = ps.train(Factorization, lambda rank, _: batches(rank), mse, config)
    assert result is not None and result.summary["steps"] == NUM_STEPS
    calls = result.summary["calls"]
    assert calls["push_pull"]["calls"] == 2  # the first pull
    assert calls["push_pulls"]["calls"] == 2 * 2  # those of groups 2 and 3
    # Every step's gradients reached both servers, each by a call of its own.
    assert [stats["pushes"] for stats in result.summary["server_stats"]] == [NUM_STEPS] * 2


def mse(out: Tensor, target: Tensor) -> Tensor:
    return ((out - target) ** 2).mean()


def test_two_trainers_in_groups_finish_and_learn() -> None:
    config = ps.TrainConfig(
        servers=2, trainers=2, mode="ssp", ssp_bound=3, launcher="threads", progress=False,
        optimizer="adagrad", lr=0.1, steps_per_call=3, seed=1,
    )  # fmt: skip
    result = ps.train(Factorization, lambda rank, _: batches(rank), mse, config)
    assert result is not None and result.summary["trainer_steps"] == [NUM_STEPS] * 2
    assert [stats["pushes"] for stats in result.summary["server_stats"]] == [2 * NUM_STEPS] * 2


def two_task_loop(named_inputs: bool) -> Any:
    """The two-task loop on dict batches: with ``named_inputs`` the trainer knows the model's
    inputs and records each step's lookups ahead; without, it reads rows on demand."""

    def loop(ctx: ps.TrainContext) -> None:
        inputs = (lambda b: (b["user"], b["items"], b["dense"])) if named_inputs else None
        for batch in ctx.batches(two_task_batches(ctx.rank, num_batches=10), inputs):
            loss = two_task_loss(ctx.model, batch)
            loss.backward()
            ctx.step(loss)

    return loop


@pytest.mark.parametrize("named_inputs", [True, False])
def test_steps_whose_lookups_are_not_known_ahead_pull_one_by_one(named_inputs: bool) -> None:
    """Without the lookups known ahead a trainer cannot pull for several steps: it calls
    once per step, and learns the same either way."""

    def job(**options: Any) -> ps.TrainResult:
        config = ps.TrainConfig(
            servers=2, trainers=1, mode="async", launcher="threads", progress=False,
            optimizer="adagrad", lr=0.1, prefetch=False, seed=2, **options,
        )  # fmt: skip
        result = ps.run(TwoTaskModel, two_task_loop(named_inputs), config)
        assert result is not None
        return result

    alone = job()
    grouped = job(steps_per_call=3)
    assert_same(state_of(grouped), state_of(alone))
    assert ("push_pulls" in grouped.summary["calls"]) == named_inputs


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"steps_per_call": 0}, "from 1 to 64, got 0"),
        ({"steps_per_call": CALLS_PER_MESSAGE + 1}, "from 1 to 64, got 65"),
        ({"steps_per_call": 2.0}, "must be of type int, got float 2.0"),
        ({"steps_per_call": 2, "mode": "sync"}, "needs --mode async or ssp"),
        ({"steps_per_call": 4, "mode": "ssp", "ssp_bound": 2}, "needs --ssp-bound >= 3"),
        ({"steps_per_call": 2, "server_pooling": ("items.weight",)}, "--server-pooling"),
        ({"steps_per_call": 2, "dense_sync": "allreduce", "trainers": 2}, "allreduce"),
    ],
)
def test_settings_that_cannot_group_steps_are_refused(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        ps.TrainConfig(mode=options.pop("mode", "async"), **options)  # type: ignore[arg-type]


def test_grouping_spends_the_ssp_bound_and_turns_prefetch_off() -> None:
    config = ps.TrainConfig(mode="ssp", ssp_bound=5, steps_per_call=4)  # type: ignore[arg-type]
    assert not config.prefetches
    assert config.consistency.ssp_bound == 2


# ---- the server's side: several calls of one trainer in one message ----


def push(endpoint: Any, call: int, value: float, trainer: int = 0) -> PushPullRequest:
    ids = own_ids(endpoint, 0)
    return PushPullRequest(
        trainer=trainer, call=call, pull_dense=False,
        row_grads={"user.weight": RowBlock(ids, torch.full((1, 4), value))},
        pull_rows={"user.weight": ids},
    )  # fmt: skip


def test_a_message_of_calls_applies_each_in_order_and_answers_the_last(
    make_server: MakeServer,
) -> None:
    endpoint = make_server()
    start = endpoint.shard.store.tables["user.weight"].weight[0].clone()
    reply = endpoint.handle("push_pulls", ([push(endpoint, c, float(c)) for c in range(3)],))
    answer = reply.wait()
    assert isinstance(answer, PushPullReply)
    # sgd, lr 1: each call's pull is answered after its own push.
    torch.testing.assert_close(answer.rows["user.weight"][0], start - 3.0)
    assert endpoint.coordinator.last_call == {0: 2}
    assert endpoint.shard.stats.pushes == 3
    # Sent again (a retry), nothing applies twice.
    endpoint.handle("push_pulls", ([push(endpoint, c, float(c)) for c in range(3)],)).wait()
    assert endpoint.shard.stats.pushes == 3


def test_a_refused_call_ends_the_message_there(make_server: MakeServer) -> None:
    """The calls before it stay applied, those after it are not looked at."""
    endpoint = make_server()
    start = endpoint.shard.store.tables["user.weight"].weight[0].clone()
    bad = push(endpoint, 1, float("nan"))
    calls = [push(endpoint, 0, 1.0), bad, push(endpoint, 2, 5.0)]
    with pytest.raises(InvalidPushError, match="NaN or Inf"):
        endpoint.handle("push_pulls", (calls,)).wait()
    torch.testing.assert_close(endpoint.shard.store.tables["user.weight"].weight[0], start - 1.0)
    assert endpoint.coordinator.last_call == {0: 0}


@pytest.mark.parametrize(
    "message",
    [
        [],
        "not a list",
        ("a", "tuple"),
        [PushPullRequest(trainer=0, call=0), "not a request"],
        [PushPullRequest(trainer=0, call=c) for c in range(CALLS_PER_MESSAGE + 1)],
    ],
    ids=["empty", "a string", "a tuple", "not a request inside", "too many"],
)
def test_a_malformed_message_is_refused_and_changes_nothing(
    make_server: MakeServer, message: object
) -> None:
    endpoint = make_server()
    with pytest.raises(ParamServerError, match="push_pulls"):
        endpoint.handle("push_pulls", (message,)).wait()
    assert endpoint.coordinator.last_call == {}
    assert endpoint.shard.stats.pushes == 0


def test_a_sync_message_joins_each_calls_round_in_turn(make_server: MakeServer) -> None:
    """Sync servers take a message too (call by call, each in its round): its answer comes
    once the other trainer's rounds have closed."""
    endpoint = make_server(mode="sync", trainers=2)
    for trainer in range(2):
        endpoint.handle("push_pull", (PushPullRequest(trainer, 0, pull_dense=False),)).wait()
    start = endpoint.shard.store.tables["user.weight"].weight[0].clone()
    message = endpoint.handle("push_pulls", ([push(endpoint, 1, 2.0), push(endpoint, 2, 2.0)],))
    assert not message.done()  # its first call waits for round 1
    endpoint.handle("push_pull", (push(endpoint, 1, 4.0, trainer=1),)).wait()
    assert not message.done()  # its second call waits for round 2
    endpoint.handle("push_pull", (push(endpoint, 2, 4.0, trainer=1),)).wait()
    torch.testing.assert_close(message.wait().rows["user.weight"][0], start - 6.0)


# ---- checkpoints ----


def test_a_grouped_job_resumes_where_it_stopped(tmp_path: Path) -> None:
    """One trainer, groups of 3, a checkpoint due every 3 steps: killed after checkpoint 3
    and resumed, it ends bitwise where an uninterrupted job ends."""

    def config(root: Path) -> ps.TrainConfig:
        return ps.TrainConfig(
            servers=2, trainers=1, mode="async", launcher="threads", progress=False,
            optimizer="adam", lr=0.05, steps_per_call=3, checkpoint_dir=str(root),
            checkpoint_every=3, seed=3,
        )  # fmt: skip

    def crashing(rank: int, _: int) -> Iterator[Any]:
        # Steps 9..11 are drawn while call 6 is under way: after call 3's answer saved the
        # trainer's part of checkpoint 3, before checkpoint 6 can be.
        for index, batch in enumerate(batches(rank)):
            if index == 9:
                wait_for_checkpoint(tmp_path / "ckpt", 3)
                raise RuntimeError("crash")
            yield batch

    straight = state_of(ps.train(Factorization, lambda r, _: batches(r), mse, config(tmp_path)))
    job = config(tmp_path / "ckpt")
    with pytest.raises(JobFailedError, match="crash"):
        ps.train(Factorization, crashing, mse, job)
    resumed = ps.train(Factorization, lambda r, _: batches(r), mse, job.replace(resume=True))
    assert resumed is not None and resumed.summary["resumed_from"]["checkpoint_step"] == 3
    assert_same(state_of(resumed), straight)
