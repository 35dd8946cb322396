"""The user's own loop: ``paramserver.run(model_fn, loop_fn, config)``."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call

import paramserver as ps
from paramserver.modelplan import initial_model
from paramserver.types import LoopFn
from tests.helpers import (
    PARITY_OPTIMIZERS,
    LazyRows,
    TinyRecModel,
    TwoTaskModel,
    mse,
    tiny_batches,
    two_task_batches,
    two_task_job,
    two_task_loop,
    two_task_loss,
    wait_for_checkpoint,
)
from tests.procs import REPO, descendants, free_port, stop

pytestmark = pytest.mark.system  # starts processes or whole jobs: the system tier

NUM_TRAINERS = 3
NUM_STEPS = 20
WARMUP, DECAY = 4, 12  # warm-up, then a cosine decay to 10% of the lr, flat after step 16
TABLES = ("user.weight", "items.weight")
OPTIMIZERS = PARITY_OPTIMIZERS


def warmup_then_cosine(step: int) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    t = min(step - WARMUP, DECAY)
    return 0.1 + 0.9 * (1 + math.cos(math.pi * t / DECAY)) / 2


def single_process_reference(name: str) -> dict[str, Tensor]:
    """torch.optim on the concatenated global batch, each table row its own Parameter whose
    grad is None when the batch does not touch it (a server's lazy per-row updates)."""
    model = initial_model(TwoTaskModel, seed=0)
    lazy = LazyRows(model, TABLES)
    optimizer_class, kwargs = OPTIMIZERS[name]
    optimizer = optimizer_class(lazy.dense + [r for rs in lazy.rows.values() for r in rs], **kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_cosine)
    streams = [two_task_batches(t) for t in range(NUM_TRAINERS)]

    class Stacked(nn.Module):  # the model with its tables' rows stacked from the Parameters
        def forward(self, *inputs: Tensor) -> tuple[Tensor, Tensor]:
            return functional_call(model, lazy.weights(), inputs)  # type: ignore[no-any-return]

        def user(self, ids: Tensor) -> Tensor:
            return torch.stack(lazy.rows["user.weight"])[ids]

    stacked = Stacked()
    for _ in range(NUM_STEPS):
        parts = [next(s) for s in streams]
        batch = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
        optimizer.zero_grad(set_to_none=True)
        two_task_loss(stacked, batch).backward()
        lazy.keep_touched({"user.weight": batch["user"], "items.weight": batch["items"]})
        optimizer.step()
        scheduler.step()
    return lazy.state()


def sync_config(optimizer: str = "adam", **changes: object) -> ps.TrainConfig:
    _, kwargs = OPTIMIZERS[optimizer]
    settings: dict[str, object] = dict(
        servers=2, trainers=NUM_TRAINERS, mode="sync", optimizer=optimizer, lr=kwargs["lr"],
        momentum=kwargs.get("momentum", 0.0), launcher="threads", progress=False,
    )  # fmt: skip
    settings.update(changes)
    return ps.TrainConfig(**settings)  # type: ignore[arg-type]


SCHEDULE = dict(lr_warmup_steps=WARMUP, lr_decay="cosine", lr_decay_steps=DECAY, lr_min_ratio=0.1)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_two_head_loop_on_dict_batches_equals_single_process(optimizer: str) -> None:
    result = ps.run(TwoTaskModel, two_task_loop, sync_config(optimizer, **SCHEDULE))
    assert result is not None and result.model is not None
    lr = OPTIMIZERS[optimizer][1]["lr"]
    assert result.summary["lr"]["dense"] == pytest.approx(0.1 * lr)  # the floor, at step 19
    assert result.summary["trainer_steps"] == [NUM_STEPS] * NUM_TRAINERS
    assert result.value["rank"] == 0 and result.value["last_loss"] > 0
    expected = single_process_reference(optimizer)
    got = result.model.state_dict()
    initial = initial_model(TwoTaskModel, seed=0).state_dict()
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert not torch.equal(value, initial[name]), f"{name} never moved: the test is vacuous"
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def fetch_on_demand(ctx: ps.TrainContext) -> None:
    """The two-task loop without ctx.batches: each step's rows come at its first forward."""
    for batch in two_task_batches(ctx.rank):
        two_task_loss(ctx.model, batch).backward()
        ctx.step()


def look_between_steps(ctx: ps.TrainContext) -> int:
    """The two-task loop, reading unseen rows under no_grad before and after every step."""
    held_out = {"user": torch.arange(20, 40), "items": torch.arange(0, 30).reshape(10, 3)}
    looks = 0
    inputs = lambda b: (b["user"], b["items"], b["dense"])  # noqa: E731
    for batch in ctx.batches(two_task_batches(ctx.rank), inputs):
        with torch.no_grad():
            ctx.model(held_out["user"][:10], held_out["items"], torch.zeros(10, 3))
        two_task_loss(ctx.model, batch).backward()
        with torch.no_grad():
            ctx.model.eval()
            ctx.model(held_out["user"][10:], held_out["items"], torch.ones(10, 3))
            ctx.model.train()
            looks += 2
        ctx.step()
    return looks


@pytest.mark.parametrize("loop", [fetch_on_demand, look_between_steps])
def test_a_loop_that_fetches_on_demand_or_looks_between_steps_trains_the_same(loop) -> None:  # type: ignore[no-untyped-def]
    expected = ps.run(TwoTaskModel, two_task_loop, sync_config())
    got = ps.run(TwoTaskModel, loop, sync_config())
    assert expected is not None and got is not None
    assert got.summary["trainer_steps"] == [NUM_STEPS] * NUM_TRAINERS
    calls = got.summary["calls"]["push_pull"]["calls"]
    assert calls == expected.summary["calls"]["push_pull"]["calls"]  # one call a step
    if loop is look_between_steps:
        assert got.value == 2 * NUM_STEPS
    for name, value in expected.model.state_dict().items():  # type: ignore[union-attr]
        assert torch.equal(got.model.state_dict()[name], value), name  # type: ignore[union-attr]


def in_passes(passes: int) -> LoopFn:
    """The two-task loop over ten batches ``passes`` times: one ``ctx.batches`` a pass, or one
    over the passes chained."""

    def loop(ctx: ps.TrainContext) -> int:
        data = [two_task_batches(ctx.rank, num_batches=10) for _ in range(2)]
        inputs = lambda b: (b["user"], b["items"], b["dense"])  # noqa: E731
        sources = data if passes == 2 else [itertools.chain(*data)]
        for source in sources:
            for batch in ctx.batches(source, inputs):
                two_task_loss(ctx.model, batch).backward()
                ctx.step()
        return ctx.steps

    return loop


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ctx_batches_may_be_opened_once_a_pass(mode: str) -> None:
    passes = ps.run(TwoTaskModel, in_passes(2), sync_config(mode=mode))
    assert passes is not None and passes.value == NUM_STEPS
    assert passes.summary["trainer_steps"] == [NUM_STEPS] * NUM_TRAINERS
    calls = passes.summary["calls"]
    assert "pull" not in calls  # every step's rows came with its call, none on demand
    if mode == "async":  # per pass: the first pull, then a call a step (see above)
        assert calls["push_pull"]["calls"] == NUM_TRAINERS * 2 * 2 * (10 + 1)
    if mode == "sync":  # prefetch makes a pass's first step fresher than it is in one stream
        chained = ps.run(TwoTaskModel, in_passes(1), sync_config())
        for name, value in chained.model.state_dict().items():  # type: ignore[union-attr]
            assert torch.equal(passes.model.state_dict()[name], value), name  # type: ignore[union-attr]


def test_train_is_run_with_the_default_loop() -> None:
    config = ps.TrainConfig(servers=2, trainers=2, mode="sync", launcher="threads", progress=False)
    result = ps.train(TinyRecModel, lambda t, n: tiny_batches(t), mse, config)
    assert result is not None and result.value is None
    assert result.summary["trainer_steps"] == [20, 20]


def test_async_prefetch_keeps_one_call_per_step_and_learns() -> None:
    config = ps.TrainConfig(servers=1, trainers=1, lr=0.1, launcher="threads", progress=False)
    result = ps.run(TwoTaskModel, two_task_loop, config)
    assert result is not None
    # The first call pulls step 0; each step's then pushes the step before it and pulls the
    # step after it, the last step's without a pull (the final call follows the report).
    assert result.summary["calls"]["push_pull"]["calls"] == NUM_STEPS + 1
    first = two_task_loss(initial_model(TwoTaskModel, 0), next(two_task_batches(0)))
    assert result.value["last_loss"] < float(first.detach())


def resumable_loop(crash_after: int | None, root: Path, own_data: bool, noisy: bool) -> LoopFn:
    """The two-task loop; trainer 0 crashes at step ``crash_after``, once the checkpoint
    before it is committed. With ``own_data`` it reads its data itself, skipping the steps
    done before a resume; ``noisy`` draws a factor of its loss from torch's RNG, whose state
    must resume too (one trainer only: under the threads launcher trainers share it)."""

    def loop(ctx: ps.TrainContext) -> None:
        batches = two_task_batches(ctx.rank)
        if own_data:
            batches = itertools.islice(batches, ctx.start_step, None)
        else:
            batches = ctx.batches(batches, lambda b: (b["user"], b["items"], b["dense"]))
        for step, batch in enumerate(batches, start=ctx.start_step):
            if ctx.rank == 0 and step == crash_after:
                wait_for_checkpoint(root, step - 1)
                raise RuntimeError("crash")
            loss = two_task_loss(ctx.model, batch)
            if noisy:
                loss = loss * (1 + 0.1 * torch.rand(()))
            loss.backward()
            ctx.step(loss)

    return loop


@pytest.mark.parametrize(
    ("own_data", "trainers"), [(False, NUM_TRAINERS), (True, NUM_TRAINERS), (False, 1)]
)
def test_a_user_loop_resumes_exactly_in_sync_mode(
    tmp_path: Path, own_data: bool, trainers: int
) -> None:
    root, noisy = tmp_path / "ckpt", trainers == 1

    def loop(crash_after: int | None) -> LoopFn:
        return resumable_loop(crash_after, root, own_data, noisy)

    straight = ps.run(TwoTaskModel, loop(None), sync_config(trainers=trainers))
    job = sync_config(trainers=trainers, checkpoint_dir=str(root), checkpoint_every=6)
    with pytest.raises(ps.JobFailedError, match="crash"):
        ps.run(TwoTaskModel, loop(7), job)
    resumed = ps.run(TwoTaskModel, loop(None), job.replace(resume=True))
    assert straight is not None and resumed is not None
    assert resumed.summary["resumed_from"]["checkpoint_step"] == 6
    for name, value in straight.model.state_dict().items():  # type: ignore[union-attr]
        assert torch.equal(resumed.model.state_dict()[name], value), name  # type: ignore[union-attr]


# ---- bad use ----


def one_trainer(**changes: object) -> ps.TrainConfig:
    settings: dict[str, object] = dict(servers=1, trainers=1, launcher="threads", progress=False)
    settings.update(changes)
    return ps.TrainConfig(**settings)  # type: ignore[arg-type]


def step_without_backward(ctx: ps.TrainContext) -> None:
    for batch in ctx.batches(two_task_batches(0)):
        two_task_loss(ctx.model, batch)
        ctx.step()


def step_twice(ctx: ps.TrainContext) -> None:
    for batch in ctx.batches(two_task_batches(0)):
        two_task_loss(ctx.model, batch).backward()
        ctx.step()
        ctx.step()


def unknown_parameter(ctx: ps.TrainContext) -> None:
    ctx.model.extra = nn.Linear(2, 1)
    for batch in ctx.batches(two_task_batches(0)):
        loss = two_task_loss(ctx.model, batch) + ctx.model.extra(torch.ones(1, 2)).sum()
        loss.backward()
        ctx.step()


def parameter_replaced_later(ctx: ps.TrainContext) -> None:
    """After steps that found the model's parameters the servers', one is replaced."""
    for step, batch in enumerate(ctx.batches(two_task_batches(0))):
        if step == 3:
            ctx.model.click.bias = nn.Parameter(torch.zeros(1))
        two_task_loss(ctx.model, batch).backward()
        ctx.step()


def module_added_later(ctx: ps.TrainContext) -> None:
    """After steps that found the model's parameters the servers', a module is added."""
    for step, batch in enumerate(ctx.batches(two_task_batches(0))):
        if step == 3:
            ctx.model.extra = nn.Linear(2, 1)
        loss = two_task_loss(ctx.model, batch)
        if step >= 3:
            loss = loss + ctx.model.extra(torch.ones(1, 2)).sum()
        loss.backward()
        ctx.step()


def forward_after_step(ctx: ps.TrainContext) -> None:
    for batch in ctx.batches(two_task_batches(0)):
        two_task_loss(ctx.model, batch).backward()
        ctx.step()
        two_task_loss(ctx.model, batch).backward()


def next_batch_without_step(ctx: ps.TrainContext) -> None:
    for batch in ctx.batches(two_task_batches(0)):
        two_task_loss(ctx.model, batch).backward()


@pytest.mark.parametrize(
    ("loop", "message"),
    [
        (step_without_backward, "no gradients: call loss.backward"),
        (step_twice, "second ctx.step"),
        (unknown_parameter, r"\['extra.weight', 'extra.bias'\].*servers do not know"),
        (parameter_replaced_later, r"\['click.bias'\].*servers do not know"),
        (module_added_later, r"\['extra.weight', 'extra.bias'\].*servers do not know"),
        (next_batch_without_step, "without calling ctx.step"),
        (forward_after_step, "a training forward after ctx.step"),
    ],
)
def test_bad_use_of_the_context_is_a_loop_error(loop, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ps.JobFailedError, match=f"LoopError: .*{message}") as failed:
        ps.run(TwoTaskModel, loop, one_trainer())
    assert isinstance(failed.value.__cause__, ps.LoopError)


def from_another_thread(ctx: ps.TrainContext) -> str:
    caught: list[BaseException] = []
    batch = next(two_task_batches(0))

    def use() -> None:
        try:
            two_task_loss(ctx.model, batch)
        except BaseException as error:
            caught.append(error)

    thread = threading.Thread(target=use)
    thread.start()
    thread.join()
    two_task_loss(ctx.model, batch).backward()
    ctx.step()
    return repr(caught[0]) if caught else "no error"


def test_a_context_used_from_another_thread_is_a_loop_error() -> None:
    result = ps.run(TwoTaskModel, from_another_thread, one_trainer())
    assert result is not None
    assert result.value.startswith("LoopError") and "belongs to the thread" in result.value
    assert result.summary["trainer_steps"] == [1]


def test_run_refuses_what_belongs_to_train() -> None:
    with pytest.raises(ps.ConfigError, match="epochs=2.*loop_fn"):
        ps.run(TwoTaskModel, two_task_loop, one_trainer(epochs=2))
    with pytest.raises(TypeError, match="loop_fn must be a function"):
        ps.run(TwoTaskModel, "loop", one_trainer())  # type: ignore[arg-type]


def raising_at_step_3(ctx: ps.TrainContext) -> None:
    for step, batch in enumerate(ctx.batches(two_task_batches(ctx.rank))):
        if step == 3 and ctx.rank == 1:
            raise ValueError("boom from the user's loop")
        two_task_loss(ctx.model, batch).backward()
        ctx.step()


@pytest.mark.timeout(120)
def test_a_loop_that_raises_stops_the_job_with_its_traceback(
    capfd: pytest.CaptureFixture[str],
) -> None:
    config = ps.TrainConfig(
        servers=1, trainers=2, mode="sync", launcher="processes", progress=False
    )
    with pytest.raises(ps.JobFailedError, match="trainer1.*boom from the user's loop"):
        ps.run(TwoTaskModel, raising_at_step_3, config)
    assert descendants(os.getpid()) == []  # the launcher stopped and reaped every process
    err = capfd.readouterr().err
    assert "Traceback" in err and "in raising_at_step_3" in err
    assert 'raise ValueError("boom from the user' in err


# ---- the launchers ----


@pytest.mark.timeout(240)
def test_the_same_loop_runs_on_threads_processes_and_torchrun(tmp_path: Path) -> None:
    """Each launcher makes its own trainers' group too (--dense-sync allreduce): a barrier of
    threads, a group met through a file, one met through torchrun's store."""
    outputs = {launcher: two_task_job(launcher) for launcher in ("threads", "processes")}
    port = free_port()
    out = tmp_path / "torchrun.pt"
    nodes = [
        subprocess.Popen(
            [
                str(Path(sys.executable).with_name("torchrun")), "--nnodes", "2",
                "--nproc-per-node", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1",
                "--master-port", str(port), "--rdzv-backend", "static",
                str(REPO / "tests" / "_loop_job.py"), str(out),
            ],
            cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), start_new_session=True,
        )
        for node in (0, 1)
    ]  # fmt: skip
    try:
        for node in nodes:
            assert node.wait(timeout=150) == 0
    finally:
        stop(*nodes)
    outputs["torchrun"] = torch.load(out)
    reference = outputs["threads"]
    assert reference["steps"] == [NUM_STEPS, NUM_STEPS]
    for launcher, output in outputs.items():
        assert output["value"]["rank"] == 0, launcher
        assert output["value"] == reference["value"], launcher
        for name, value in reference["state"].items():
            assert torch.equal(output["state"][name], value), f"{launcher}: {name}"
