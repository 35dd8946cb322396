"""Learning-rate schedules: the built-in shapes, their checks (flags, TOML, [tables.NAME],
Python), the step each update sees on a server (async, ssp, sync), parity with
torch.optim.lr_scheduler.LambdaLR, per-table schedules, exact resume, and the lr in the
metrics and the summary."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import paramserver as ps
from paramserver.baseline import train_single_process
from paramserver.cli import main
from paramserver.config import TrainConfig, read_toml
from paramserver.errors import ConfigError, JobFailedError
from paramserver.modelplan import initial_model
from paramserver.observe.runlog import read_records
from paramserver.optim import make_rule
from paramserver.optimconfig import OptimizerConfig
from paramserver.schedule import Schedule
from paramserver.server.endpoint import ServerEndpoint
from paramserver.wire.messages import PushPullRequest, RowBlock
from tests.helpers import (
    PARITY_OPTIMIZERS,
    HashedModel,
    LazyRows,
    MakeServer,
    TinyRecModel,
    a_dense_name,
    crashing_after,
    hashed_batches,
    mse,
    own_ids,
    tiny_batches,
    tiny_single_process,
)

TABLES = ("user.weight", "items.weight")

# ---- the built-in shapes, against their formulas ----------------------------------------------

# (schedule, base lr, {step: factor}) with the factors worked out by hand from the documented
# formulas (W warm-up, t = step - W, D decay steps, r rate, f floor).
SHAPES = {
    "warm-up, no decay": (
        Schedule(warmup_steps=4),
        0.1,
        {0: 0.25, 1: 0.5, 2: 0.75, 3: 1.0, 4: 1.0, 1000: 1.0},
    ),
    "linear to a ratio floor": (
        Schedule(warmup_steps=2, decay="linear", decay_steps=10, min_ratio=0.2),
        0.1,
        {0: 0.5, 1: 1.0, 2: 1.0, 7: 0.2 + 0.8 * 0.5, 12: 0.2, 500: 0.2},
    ),
    "cosine to 0": (
        Schedule(decay="cosine", decay_steps=10),
        0.1,
        {0: 1.0, 5: 0.5, 10: 0.0, 11: 0.0, 2: (1 + math.cos(math.pi * 0.2)) / 2},
    ),
    "cosine to an absolute floor": (
        Schedule(warmup_steps=5, decay="cosine", decay_steps=10, min_lr=0.01),
        0.1,  # floor 0.01 / 0.1 = 0.1 of the lr
        {4: 1.0, 5: 1.0, 10: 0.1 + 0.9 * 0.5, 15: 0.1, 99: 0.1},
    ),
    "exponential": (
        Schedule(decay="exponential", decay_steps=4, decay_rate=0.5),
        1.0,
        {0: 1.0, 2: 0.5**0.5, 4: 0.5, 6: 0.5**1.5, 8: 0.25},
    ),
    "exponential, floored": (
        Schedule(warmup_steps=1, decay="exponential", decay_steps=4, decay_rate=0.5, min_ratio=0.3),
        1.0,
        {0: 1.0, 5: 0.5, 9: 0.3, 100: 0.3},
    ),
    "step (staircase)": (
        Schedule(decay="step", decay_steps=4, decay_rate=0.5),
        1.0,
        {0: 1.0, 3: 1.0, 4: 0.5, 7: 0.5, 8: 0.25, 12: 0.125},
    ),
    "step, default rate 0.1": (
        Schedule(decay="step", decay_steps=3),
        1.0,
        {2: 1.0, 3: 0.1, 6: 0.1**2},
    ),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_built_in_shape_follows_its_formula(shape: str) -> None:
    schedule, base_lr, expected = SHAPES[shape]
    for step, factor in expected.items():
        assert schedule.factor(step, base_lr) == pytest.approx(factor, abs=1e-12), step


def test_the_config_gives_the_scheduled_rate_of_each_group() -> None:
    config = TrainConfig(
        lr=0.2, table_lr=0.5, lr_warmup_steps=2, lr_decay="linear", lr_decay_steps=4,
        lr_min=0.1,
    )  # fmt: skip
    # Step 4 is t = 2 of 4: halfway from the lr to the floor, an absolute lr for each group.
    rates = config.learning_rates.at(4, ["emb.weight"])
    assert rates == pytest.approx({"dense": 0.15, "emb.weight": 0.3})
    assert config.learning_rates.at(0, []) == pytest.approx({"dense": 0.1})  # warm-up: 1/2
    assert config.dense_optimizer().lr_factor(100) == pytest.approx(0.5)  # the floor, 0.1/0.2


# ---- bad values, refused wherever they are given ---------------------------------------------

# (TrainConfig keys, the words the ConfigError must hold)
BAD = [
    ({"lr_warmup_steps": -1}, "--lr-warmup-steps"),
    ({"lr_warmup_steps": 1.5}, "--lr-warmup-steps"),
    ({"lr_decay": "sqrt"}, "--lr-decay"),
    ({"lr_decay": "cosine"}, "--lr-decay-steps"),
    ({"lr_decay": "linear", "lr_decay_steps": 0}, "--lr-decay-steps"),
    ({"lr_decay_steps": 5}, "--lr-decay-steps .* needs --lr-decay"),
    ({"lr_decay": "exponential", "lr_decay_steps": 5, "lr_decay_rate": 1.5}, "--lr-decay-rate"),
    ({"lr_decay": "step", "lr_decay_steps": 5, "lr_decay_rate": 0.0}, "--lr-decay-rate"),
    ({"lr_decay": "cosine", "lr_decay_steps": 5, "lr_decay_rate": 0.5}, "--lr-decay-rate"),
    ({"lr_decay": "cosine", "lr_decay_steps": 5, "lr_min_ratio": 1.5}, "--lr-min-ratio"),
    ({"lr_decay": "cosine", "lr_decay_steps": 5, "lr_min": -0.1}, "--lr-min"),
    ({"lr_decay": "cosine", "lr_decay_steps": 5, "lr_min": 1.0}, "--lr-min .* exceeds the lr"),
    (
        {"lr_decay": "cosine", "lr_decay_steps": 5, "lr_min": 0.01, "lr_min_ratio": 0.1},
        "--lr-min .* --lr-min-ratio .* give one",
    ),
    ({"lr_min_ratio": 0.1}, "need --lr-decay"),
    ({"lr_decay": 0.1}, "adagrad_lr_decay"),
]


@pytest.mark.parametrize(("values", "words"), BAD)
def test_bad_values_are_refused_in_python_naming_the_flag(
    values: dict[str, Any], words: str
) -> None:
    with pytest.raises(ConfigError, match=words):
        TrainConfig(lr=0.05, **values)


def _cli_words(values: dict[str, Any]) -> list[str]:
    return [w for k, v in values.items() for w in (f"--{k.replace('_', '-')}", str(v))]


# Were a check missing, the job these flags start would be short.
QUICK = ["--steps", "1", "--train-batches", "2", "--rows-per-table", "100", "--launcher",
         "threads", "--no-progress"]  # fmt: skip


@pytest.mark.parametrize(("values", "words"), BAD)
def test_bad_values_are_refused_as_flags(
    values: dict[str, Any], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused with exit status 2: by argparse (a value of the wrong type, a decay it does
    not know) or by the config's checks."""
    try:
        status = main(["train", "--lr", "0.05", *QUICK, *_cli_words(values)])
    except SystemExit as exit:  # argparse's refusal
        status = exit.code  # type: ignore[assignment]
    assert status == 2
    assert re.search(words, capsys.readouterr().err)


def _toml_value(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


@pytest.mark.parametrize(("values", "words"), BAD)
def test_bad_values_are_refused_in_toml_and_in_a_table_section(
    values: dict[str, Any], words: str, tmp_path: Path
) -> None:
    lines = "\n".join(f"{k} = {_toml_value(v)}" for k, v in values.items())
    top = tmp_path / "top.toml"
    top.write_text(f"lr = 0.05\n{lines}\n")
    with pytest.raises(ConfigError, match=words):
        TrainConfig(**read_toml(top))
    table = tmp_path / "table.toml"
    table.write_text(f'[tables."emb.weight"]\nlr = 0.05\n{lines}\n')
    with pytest.raises(ConfigError, match=rf"\[tables.emb.weight\].*{words}"):
        TrainConfig(**read_toml(table))


def test_a_numeric_lr_decay_is_refused_naming_adagrad_lr_decay_which_works(
    tmp_path: Path,
) -> None:
    """``lr_decay`` now names the schedule's decay; torch Adagrad's own per-step decay (the
    number ``lr_decay`` used to be) is ``adagrad_lr_decay``, and follows torch's math."""
    with pytest.raises(ConfigError, match="adagrad_lr_decay"):
        OptimizerConfig(name="adagrad", lr_decay=0.1)  # type: ignore[arg-type]
    path = tmp_path / "job.toml"
    path.write_text('[tables."emb.weight"]\nname = "adagrad"\nlr_decay = 0.1\n')
    with pytest.raises(ConfigError, match=r"\[tables.emb.weight\].*adagrad_lr_decay"):
        read_toml(path)
    path.write_text('[tables."emb.weight"]\nname = "adagrad"\nadagrad_lr_decay = 0.1\n')
    rule_config = TrainConfig(**read_toml(path)).table_optimizer_for("emb.weight")
    assert rule_config.adagrad_lr_decay == 0.1
    rule = make_rule(rule_config)
    weight = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    reference = nn.Parameter(weight.clone())
    optimizer = torch.optim.Adagrad([reference], lr=rule_config.lr, lr_decay=0.1)
    state, count = rule.init_state(weight), torch.zeros(())
    for step in range(4):
        grad = torch.full_like(weight, float(step + 1))
        rule.step(weight, grad, state, count, rule_config.lr)
        reference.grad = grad
        optimizer.step()
    torch.testing.assert_close(weight, reference.detach())


def test_a_python_schedule_and_built_in_keys_are_refused_together() -> None:
    with pytest.raises(ConfigError, match="lr_schedule and lr_warmup_steps .* give one"):
        TrainConfig(lr_schedule=lambda s: 1.0, lr_warmup_steps=3)
    with pytest.raises(ConfigError, match="lr_schedule and lr_decay, lr_decay_steps"):
        OptimizerConfig(lr_schedule=lambda s: 1.0, lr_decay="cosine", lr_decay_steps=3)
    with pytest.raises(ConfigError, match="lr_schedule must be a function"):
        TrainConfig(lr_schedule="cosine")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("schedule", "words"),
    [
        (lambda s: float("nan"), "returned nan at step 0"),
        (lambda s: float("inf"), "returned inf at step 0"),
        (lambda s: -0.5, "returned -0.5 at step 0"),
        (lambda s: "fast", "returned 'fast' at step 0"),
        (lambda s: torch.tensor(1.0), "returned tensor"),
        (lambda s: 1 / s, "raised at step 0: ZeroDivisionError"),
    ],
)
def test_a_bad_python_schedule_is_refused_at_step_0_naming_the_group(
    schedule: Callable[[int], Any], words: str
) -> None:
    with pytest.raises(ConfigError, match=f"lr_schedule of 'dense' {words}"):
        TrainConfig(lr_schedule=schedule)
    own = {"emb.weight": OptimizerConfig(lr_schedule=schedule)}
    with pytest.raises(ConfigError, match=f"lr_schedule of 'emb.weight' {words}"):
        TrainConfig(table_optimizers=own)


# ---- the step a server's update sees --------------------------------------------------------


def halving(step: int) -> float:
    return 0.5**step


def push(
    endpoint: ServerEndpoint, trainer: int, call: int, grads_call: int, value: float
) -> torch.futures.Future:
    """A push of ``value`` to one row of user.weight and to a dense parameter."""
    dense = a_dense_name(endpoint)
    shape = endpoint.shard.store.dense[dense].value.shape
    request = PushPullRequest(
        trainer=trainer,
        call=call,
        grads_call=grads_call,
        pull_dense=False,
        dense_grads={dense: torch.full(shape, value)},
        row_grads={"user.weight": RowBlock(own_ids(endpoint, 0), torch.full((1, 4), value))},
    )
    return endpoint.handle("push_pull", (request,))


def moved(endpoint: ServerEndpoint, before: tuple[torch.Tensor, torch.Tensor]) -> list[float]:
    """How far (SGD at lr 1: minus lr x gradient) the row and the dense parameter moved."""
    row = endpoint.shard.store.tables["user.weight"].weight[0]
    dense = endpoint.shard.store.dense[a_dense_name(endpoint)].value
    return [float((row - before[0])[0]), float((dense - before[1]).view(-1)[0])]


def values_of(endpoint: ServerEndpoint) -> tuple[torch.Tensor, torch.Tensor]:
    row = endpoint.shard.store.tables["user.weight"].weight[0].clone()
    return row, endpoint.shard.store.dense[a_dense_name(endpoint)].value.clone()


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_and_ssp_apply_each_push_at_its_own_trainers_step(
    mode: str, make_server: MakeServer
) -> None:
    """A push's step is the call its gradients were computed from (grads_call), not its own
    call number: with prefetch, call 2 carries step 0's gradients."""
    endpoint = make_server(mode=mode, lr_schedule=halving, ssp_bound=5)
    for trainer, call, grads_call, factor in [
        (0, 0, -1, 0.0),  # initial pulls: nothing applied
        (1, 0, -1, 0.0),
        (0, 1, 0, 1.0),  # trainer 0, step 0
        (0, 2, 1, 0.5),  # trainer 0, step 1
        (0, 3, 2, 0.25),
        (1, 1, -1, 0.0),  # trainer 1 prefetches: call 1 carries no gradients ...
        (1, 2, 0, 1.0),  # ... call 2 carries step 0's
    ]:
        before = values_of(endpoint)
        if grads_call < 0:
            request = PushPullRequest(trainer=trainer, call=call, pull_dense=False)
            endpoint.handle("push_pull", (request,)).wait()
        else:
            push(endpoint, trainer, call, grads_call, 1.0).wait()
        assert moved(endpoint, before) == pytest.approx([-factor, -factor]), (trainer, call)


def test_a_sync_round_applies_its_step_every_trainers_step_t_minus_1(
    make_server: MakeServer,
) -> None:
    endpoint = make_server(mode="sync", trainers=2, lr_schedule=halving)
    for trainer in range(2):
        endpoint.handle("push_pull", (PushPullRequest(trainer=trainer, call=0),)).wait()
    for call in (1, 2, 3):
        before = values_of(endpoint)
        waiters = [push(endpoint, t, call, call - 1, 1.0 + 2 * t) for t in range(2)]
        for waiter in waiters:
            waiter.wait()
        factor = 0.5 ** (call - 1)  # round `call` holds step call - 1; the mean gradient is 2
        assert moved(endpoint, before) == pytest.approx([-2 * factor, -2 * factor]), call


def fails_from(step: int, bad: object) -> Callable[[int], Any]:
    return lambda s: 1.0 if s < step else bad


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("bad", [float("nan"), -1.0, "x"])
def test_a_bad_factor_on_a_server_is_refused_and_changes_nothing(
    mode: str, bad: object, make_server: MakeServer
) -> None:
    endpoint = make_server(mode=mode, trainers=1, lr_schedule=fails_from(1, bad))
    endpoint.handle("push_pull", (PushPullRequest(trainer=0, call=0),)).wait()
    push(endpoint, 0, 1, 0, 1.0).wait()  # step 0 is fine
    before = endpoint.shard.store.state_hash()
    with pytest.raises(ConfigError, match="lr_schedule of 'dense' returned .* at step 1"):
        push(endpoint, 0, 2, 1, 1.0).wait()
    assert endpoint.shard.store.state_hash() == before
    ids = own_ids(endpoint, 0)
    rows_only = PushPullRequest(
        trainer=0, call=3, grads_call=2, row_grads={"user.weight": RowBlock(ids, torch.ones(1, 4))}
    )
    with pytest.raises(ConfigError, match="lr_schedule of 'user.weight' returned .* at step 2"):
        endpoint.handle("push_pull", (rows_only,)).wait()
    assert endpoint.shard.store.state_hash() == before


def test_a_job_whose_schedule_fails_midway_stops_naming_the_step() -> None:
    config = ps.TrainConfig(
        servers=2, trainers=2, mode="sync", launcher="threads", progress=False,
        lr_schedule=fails_from(4, float("nan")),
    )  # fmt: skip
    with pytest.raises(JobFailedError, match="ConfigError.*returned nan at step 4"):
        ps.train(TinyRecModel, lambda t, n: tiny_batches(t, num_batches=8), mse, config)


# ---- parity with torch.optim.lr_scheduler.LambdaLR -------------------------------------------

NUM_TRAINERS = 2
NUM_STEPS = 20
OPTIMIZERS = PARITY_OPTIMIZERS
WARMUP_COSINE = {
    "lr_warmup_steps": 5, "lr_decay": "cosine", "lr_decay_steps": 12, "lr_min_ratio": 0.1,
}  # fmt: skip


def warmup_then_cosine(step: int) -> float:
    """WARMUP_COSINE written out: 5 steps up, then cosine to 0.1 over 12 steps."""
    if step < 5:
        return (step + 1) / 5
    return 0.1 + 0.9 * (1 + math.cos(math.pi * min(step - 5, 12) / 12)) / 2


def reference(
    name: str, schedules: dict[str, Callable[[int], float]], lrs: dict[str, float]
) -> dict[str, torch.Tensor]:
    """Plain torch.optim on the concatenated global batch with one LambdaLR over three param
    groups (dense, then each table). Each table row is its own Parameter whose grad is None
    when the batch does not touch it, so torch.optim skips it: a server's lazy rows."""
    optimizer_class, kwargs = OPTIMIZERS[name]
    kwargs = {k: v for k, v in kwargs.items() if k != "lr"}

    def optimizing(lazy: LazyRows) -> tuple[torch.optim.Optimizer, object]:
        groups = [{"params": lazy.dense, "lr": lrs["dense"]}]
        groups += [{"params": lazy.rows[t], "lr": lrs[t]} for t in TABLES]
        optimizer = optimizer_class(groups, **kwargs)
        lambdas = [schedules["dense"], *[schedules[t] for t in TABLES]]
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)

    return tiny_single_process(optimizing, NUM_TRAINERS, NUM_STEPS)


def assert_trained_as(result: ps.TrainResult, expected: dict[str, torch.Tensor]) -> None:
    assert result.summary["trainer_steps"] == [NUM_STEPS] * NUM_TRAINERS
    got = result.model.state_dict()
    assert set(got) == set(expected)
    initial = initial_model(TinyRecModel, seed=0).state_dict()
    for name, value in expected.items():
        assert not torch.equal(value, initial[name]), f"{name} never moved: the test is vacuous"
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_sync_with_warmup_then_cosine_equals_lambda_lr_on_the_global_batch(
    optimizer: str,
) -> None:
    _, kwargs = OPTIMIZERS[optimizer]
    config = ps.TrainConfig(
        servers=2, trainers=NUM_TRAINERS, mode="sync", optimizer=optimizer, lr=kwargs["lr"],
        momentum=kwargs.get("momentum", 0.0), launcher="threads", progress=False,
        **WARMUP_COSINE,
    )  # fmt: skip
    result = ps.train(TinyRecModel, lambda t, n: tiny_batches(t), mse, config)
    assert result is not None
    lrs = {"dense": kwargs["lr"], **dict.fromkeys(TABLES, kwargs["lr"])}
    expected = reference(optimizer, dict.fromkeys(["dense", *TABLES], warmup_then_cosine), lrs)
    assert_trained_as(result, expected)


def job_inverse(step: int) -> float:
    return 1 / (1 + step)


@pytest.mark.timeout(120)
def test_a_tables_own_schedule_is_honoured_beside_the_jobs() -> None:
    """The job's schedule (a Python function) applies to the dense parameters and to
    items.weight; user.weight's own rule (a [tables.NAME] section's keys) has its own
    built-in step decay, and its own lr (SGD with momentum 0.9 everywhere, as the reference's
    OPTIMIZERS["sgd"])."""
    own = OptimizerConfig(
        name="sgd", lr=0.3, momentum=0.9, lr_warmup_steps=2, lr_decay="step", lr_decay_steps=3,
        lr_decay_rate=0.5,
    )  # fmt: skip
    config = ps.TrainConfig(
        servers=2, trainers=NUM_TRAINERS, mode="sync", optimizer="sgd", lr=0.1, momentum=0.9,
        launcher="threads", progress=False, lr_schedule=job_inverse,
        table_optimizers={"user.weight": own},
    )  # fmt: skip
    result = ps.train(TinyRecModel, lambda t, n: tiny_batches(t), mse, config)
    assert result is not None

    def user_schedule(step: int) -> float:
        return (step + 1) / 2 if step < 2 else 0.5 ** ((step - 2) // 3)

    schedules = {"dense": job_inverse, "items.weight": job_inverse, "user.weight": user_schedule}
    lrs = {"dense": 0.1, "items.weight": 0.1, "user.weight": 0.3}
    assert_trained_as(result, reference("sgd", schedules, lrs))
    last = NUM_STEPS - 1
    assert result.summary["lr"] == pytest.approx(
        {"dense": 0.1 / 20, "items.weight": 0.1 / 20, "user.weight": 0.3 * 0.5 ** (17 // 3)}
    )
    assert result.summary["lr"]["user.weight"] == pytest.approx(0.3 * user_schedule(last))


# Each kind of table, one trainer in sync mode against the single-process reference
# (paramserver.baseline, --compare-single-process): (model, batches, optimizer, options)
KINDS = {
    "fixed": (TinyRecModel, tiny_batches, "adagrad", {}),
    "fixed, pooled on the servers": (
        TinyRecModel,
        tiny_batches,
        "sgd",
        {"server_pooling": ("items.weight",)},
    ),
    "dynamic": (lambda: HashedModel(dynamic=True), hashed_batches, "adagrad", {}),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_single_process_reference_follows_the_same_schedule(kind: str) -> None:
    model, batches, optimizer, options = KINDS[kind]
    config = ps.TrainConfig(
        servers=2, trainers=1, mode="sync", optimizer=optimizer, lr=0.2, launcher="threads",
        progress=False, lr_warmup_steps=3, lr_decay="exponential", lr_decay_steps=2,
        lr_decay_rate=0.5, lr_min_ratio=0.05, **options,
    )  # fmt: skip
    data = lambda t, n: batches(t, num_batches=12)  # noqa: E731
    result = ps.train(model, data, mse, config)
    assert result is not None
    local, _ = train_single_process(model, data, mse, config)
    flat, _ = train_single_process(model, data, mse, config.replace(lr_warmup_steps=0))
    served, expected, unscheduled = (
        m.state_dict() for m in (result.model, local, flat)
    )  # fmt: skip
    assert served.keys() == expected.keys()
    for name, value in served.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.allclose(expected[n], unscheduled[n]) for n in expected), (
        "the warm-up changed nothing: the test is vacuous"
    )


# ---- resume, metrics, summary, launchers -----------------------------------------------------

STEPS = 12
SCHEDULE = {"lr_warmup_steps": 3, "lr_decay": "linear", "lr_decay_steps": 8, "lr_min_ratio": 0.2}


@pytest.mark.timeout(120)
def test_sync_resume_continues_the_schedule_bitwise(tmp_path: Path) -> None:
    def job(root: Path, **options: Any) -> ps.TrainConfig:
        return ps.TrainConfig(
            servers=2, trainers=2, mode="sync", optimizer="adam", lr=0.01, launcher="threads",
            progress=False, checkpoint_dir=str(root), **SCHEDULE, **options,
        )  # fmt: skip

    data = lambda t, n: tiny_batches(t, num_batches=STEPS)  # noqa: E731
    straight = ps.train(TinyRecModel, data, mse, job(tmp_path / "a"))
    saved_at = 6  # mid-decay: a schedule restarted at step 0 would warm up again
    crashing = job(tmp_path / "b", checkpoint_every=saved_at)
    with pytest.raises(JobFailedError, match="crash"):
        ps.train(
            TinyRecModel, crashing_after(saved_at, tmp_path / "b", num_batches=STEPS), mse, crashing
        )
    resumed = ps.train(TinyRecModel, data, mse, crashing.replace(resume=True))
    assert straight is not None and resumed is not None
    assert resumed.summary["resumed_from"]["checkpoint_step"] == saved_at
    expected = straight.model.state_dict()
    for name, value in resumed.model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert resumed.summary["lr"] == straight.summary["lr"]


@pytest.mark.timeout(120)
def test_the_lr_of_each_group_is_in_the_run_records_and_the_summary(tmp_path: Path) -> None:
    config = ps.TrainConfig(
        servers=2, trainers=2, mode="async", optimizer="adagrad", lr=0.1, table_lr=0.4,
        launcher="threads", progress=False, run_dir=str(tmp_path), metrics_every=4,
        tensorboard=False, **SCHEDULE,
    )  # fmt: skip
    result = ps.train(TinyRecModel, lambda t, n: tiny_batches(t, num_batches=STEPS), mse, config)
    assert result is not None

    def expected(step: int) -> dict[str, float]:  # the last step done: step - 1
        s = step - 1
        factor = (s + 1) / 3 if s < 3 else 0.2 + 0.8 * max(0.0, 1 - (s - 3) / 8)
        return {"dense": 0.1 * factor, "user.weight": 0.4 * factor, "items.weight": 0.4 * factor}

    assert result.summary["lr"] == pytest.approx(expected(STEPS))
    for trainer in range(2):
        records = [r for r in read_records(tmp_path)[f"trainer-{trainer}"] if r["kind"] == "train"]
        assert [r["step"] for r in records] == [4, 8, 12]
        for record in records:
            rates = {k[len("lr/") :]: v for k, v in record.items() if k.startswith("lr/")}
            assert rates == pytest.approx(expected(record["step"])), record


@pytest.mark.system
@pytest.mark.timeout(180)
def test_a_python_schedule_travels_to_worker_processes() -> None:
    """The processes launcher ships the config with cloudpickle: a closure works there."""
    scale = 0.25

    def closure(step: int) -> float:
        return scale if step >= 2 else 1.0

    config = ps.TrainConfig(
        servers=1, trainers=1, launcher="processes", progress=False, lr_schedule=closure
    )
    result = ps.train(TinyRecModel, lambda t, n: tiny_batches(t, num_batches=4), mse, config)
    assert result is not None
    assert result.summary["lr"] == pytest.approx(dict.fromkeys(["dense", *TABLES], 0.05 * scale))
