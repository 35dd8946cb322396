"""Models written the way recommendation libraries write them train unchanged, and match one
process in sync mode; what cannot be sharded is refused before any process starts, naming the
table."""

from __future__ import annotations

import pickle
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tritonclient.http as triton_http
from torch import Tensor, nn
from tritonclient.utils import np_to_triton_dtype

import paramserver as ps
from paramserver.baseline import train_single_process
from paramserver.errors import JobFailedError, LoopError, ModelError
from paramserver.launch.processes import dumps_keeping_sources
from paramserver.modelplan import build_model, initial_model, plan_of, table_aliases
from paramserver.trainer.replica import Replica
from tests.field_models import (
    NUM_ITEMS,
    STEPS,
    AttentionPooledHistory,
    BatchNormedFields,
    SharedItemTable,
    TiedLayers,
    attention_pooled_batches,
    batch_normed_batches,
    mse,
    shared_item_batches,
    tied_layer_batches,
)

MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Iterator]]] = {
    "shared item table": (SharedItemTable, shared_item_batches),
    "tied layers": (TiedLayers, tied_layer_batches),
    "attention pooled history": (AttentionPooledHistory, attention_pooled_batches),
    "batch normed fields": (BatchNormedFields, batch_normed_batches),
}


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_field_model_matches_one_process(name: str, optimizer: str) -> None:
    model_fn, batches = MODELS[name]
    config = ps.TrainConfig(
        servers=2,
        trainers=1,
        mode="sync",
        optimizer=optimizer,
        lr=0.05,
        launcher="threads",
        progress=False,
    )
    result = ps.train(model_fn, lambda t, n: batches(t), mse, config)
    assert result is not None and result.model is not None
    assert result.summary["trainer_steps"] == [STEPS]
    returned = {k: v.clone() for k, v in result.model.state_dict().items()}
    reference, _ = train_single_process(model_fn, lambda t, n: batches(t), mse, config)
    expected, got = reference.state_dict(), result.model.state_dict()
    for key, value in returned.items():  # training another build left the returned model
        assert torch.equal(got[key], value), f"{key} changed when another model trained"
    assert set(got) == set(expected)
    initial = initial_model(model_fn, seed=0).state_dict()
    for key, value in expected.items():
        assert not torch.equal(value, initial[key]), f"{key} never moved: the test is vacuous"
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_shared_weight_is_one_table_and_stays_shared() -> None:
    model = build_model(TiedLayers, seed=0).model
    assert sorted(plan_of(model, 2).tables) == ["category.weight", "item.weight"]
    assert table_aliases(model) == {"history.weight": "item.weight"}
    result = ps.train(
        TiedLayers,
        lambda t, n: tied_layer_batches(t),
        mse,
        ps.TrainConfig(servers=2, trainers=1, launcher="threads", progress=False, steps=2),
    )
    assert result is not None and result.model is not None
    assert result.model.history.weight is result.model.item.weight


def test_a_constructor_that_moves_itself_keeps_its_tables_off_memory() -> None:
    built = build_model(SharedItemTable, seed=0)
    assert built.model.item.weight.is_meta and built.model.user.weight.is_meta
    assert set(built.inits) == {"item.weight", "user.weight"}  # replayed row by row


class TiedToLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.item = nn.Embedding(NUM_ITEMS, 4)
        self.out = nn.Linear(4, int(NUM_ITEMS), bias=False)
        self.out.weight = self.item.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(self.item(ids))


class WithMaxNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.item = nn.EmbeddingBag(10, 4, max_norm=1.0)

    def forward(self, ids: Tensor) -> Tensor:
        return self.item(ids)


@pytest.mark.parametrize(
    ("model_fn", "message"),
    [
        (TiedToLinear, r"table item\.weight: its weight is also the weight of out \(Linear\)"),
        (WithMaxNorm, r"table item\.weight: max_norm renormalizes"),
    ],
)
def test_what_cannot_be_sharded_is_refused_before_any_process_starts(
    model_fn: Callable[[], nn.Module], message: str
) -> None:
    def never_read(trainer: int, num_trainers: int) -> Iterator:
        raise AssertionError("the job started")

    config = ps.TrainConfig(servers=1, trainers=1, launcher="processes", progress=False)
    with pytest.raises(ModelError, match=message):
        ps.train(model_fn, never_read, mse, config)


class MisusedWeight(nn.Module):
    def __init__(self, use: str) -> None:
        super().__init__()
        self.item = nn.Embedding(10, 4)
        self.use = use

    def forward(self, ids: Tensor) -> Tensor:
        if self.use == "max_norm":
            return F.embedding(ids, self.item.weight, max_norm=1.0)
        return self.item(ids) + self.item.weight.pow(2).sum()  # an L2 term over the table


@pytest.mark.parametrize(
    ("use", "message"),
    [
        ("max_norm", r"table item\.weight: max_norm renormalizes"),
        ("l2", r"table item\.weight: its weight is used by pow.*weight_decay"),
    ],
)
def test_a_weight_used_other_than_by_lookups_is_refused_naming_the_table(
    use: str, message: str
) -> None:
    replica = Replica(MisusedWeight(use))
    with pytest.raises(ModelError, match=message):
        replica.record_ids([(torch.tensor([1, 2]),)])
    assert replica.model.item.weight.shape == (10, 4)  # its shape may still be asked


@pytest.mark.system
def test_a_field_model_trains_in_worker_processes() -> None:
    """The path where numpy sizes first failed: the plan's fingerprint compared over RPC."""
    config = ps.TrainConfig(servers=2, trainers=1, launcher="processes", progress=False)
    result = ps.train(SharedItemTable, lambda t, n: shared_item_batches(t), mse, config)
    assert result is not None and result.summary["trainer_steps"] == [STEPS]


def test_user_functions_keep_their_file_and_lines_in_worker_processes(tmp_path: Path) -> None:
    """Functions of the user's script (``__main__``) travel by value; their tracebacks in a
    worker still name the script's file and line."""
    script = tmp_path / "user_job.py"
    script.write_text("def model_fn():\n    raise ValueError('in the user model')\n")
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec(compile(script.read_text(), str(script), "exec"), namespace)
    model_fn = namespace["model_fn"]
    assert "<dynamic-code>" in repr(pickle.loads(cloudpickle.dumps(model_fn)).__code__)

    shipped = pickle.loads(dumps_keeping_sources(model_fn))
    with pytest.raises(ValueError) as raised:
        shipped()
    frame = traceback.extract_tb(raised.value.__traceback__)[-1]
    assert (frame.filename, frame.lineno, frame.line) == (
        str(script),
        2,
        "raise ValueError('in the user model')",
    )


def loop_with_its_own_optimizer(make: str) -> Callable[[ps.TrainContext], dict[str, Tensor]]:
    """A DDP-style loop: its own torch.optim over ctx.model.parameters(), stepped after
    ctx.step(); ``make`` says how it goes wrong, if it does."""

    def loop(ctx: ps.TrainContext) -> dict[str, Tensor]:
        params = list(ctx.model.parameters())
        optimizer = torch.optim.SGD(params[:1] if make == "partial" else params, lr=0.05)
        for inputs, target in ctx.batches(shared_item_batches(ctx.rank)):
            mse(ctx.model(*inputs), target).backward()
            if make == "before ctx.step":
                optimizer.step()
            ctx.step()
            optimizer.step()
            if make == "twice":
                optimizer.step()
            optimizer.zero_grad()
        return {k: v.detach().clone() for k, v in ctx.model.state_dict().items()}

    return loop


def test_the_loops_own_optimizer_steps_the_dense_parameters_under_allreduce() -> None:
    """The same SGD, once as the job's dense rule and once as the loop's own optimizer: the
    same model (2 trainers, sync, the dense parameters all-reduced)."""
    config = ps.TrainConfig(
        servers=1,
        trainers=2,
        mode="sync",
        dense_sync="allreduce",
        optimizer="sgd",
        lr=0.05,
        launcher="threads",
        progress=False,
    )
    own = ps.run(SharedItemTable, loop_with_its_own_optimizer("right"), config)
    rule = ps.train(SharedItemTable, lambda t, n: shared_item_batches(t), mse, config)
    assert own is not None and own.model is not None and rule is not None
    assert rule.model is not None
    initial = initial_model(SharedItemTable, seed=0).state_dict()
    got, expected = own.model.state_dict(), rule.model.state_dict()
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert not torch.equal(value, initial[key]), f"{key} never moved: the test is vacuous"
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
        # The chief's replica (what the loop returned) holds the gathered dense values.
        if key in own.value:
            torch.testing.assert_close(own.value[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize(
    ("dense_sync", "make", "message"),
    [
        ("server", "right", "the servers hold them.*--dense-sync allreduce"),
        ("allreduce", "before ctx.step", r"call optimizer.step\(\) after ctx.step"),
        ("allreduce", "twice", r"without a ctx.step\(\) before it"),
        ("allreduce", "partial", "steps only some of ctx.model's dense parameters"),
    ],
)
def test_the_loops_own_optimizer_is_refused_where_it_cannot_work(
    dense_sync: str, make: str, message: str
) -> None:
    config = ps.TrainConfig(
        servers=1, trainers=2, dense_sync=dense_sync, launcher="threads", progress=False
    )
    with pytest.raises((LoopError, JobFailedError), match=message):
        ps.run(SharedItemTable, loop_with_its_own_optimizer(make), config)
    # Outside a job the same model and optimizer are the user's own again.
    model = SharedItemTable()
    torch.optim.SGD(model.parameters(), lr=0.1).step()


def test_a_script_run_by_a_spawned_process_travels_by_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under multiprocessing's spawn the user's script is ``__mp_main__``, which no worker
    can import: its functions must travel whole."""
    script = types.ModuleType("__mp_main__")
    exec("def loss(x):\n    return x + 1\n", script.__dict__)
    monkeypatch.setitem(sys.modules, "__mp_main__", script)
    shipped = dumps_keeping_sources(script.loss)
    monkeypatch.delitem(sys.modules, "__mp_main__")  # as in a worker
    assert pickle.loads(shipped)(1) == 2


def test_values_given_through_data_keep_a_table_off_memory() -> None:
    """facebookresearch/dlrm gives its tables values by ``weight.data = torch.tensor(numpy)``:
    recorded as given values, the weight stays on the meta device and every process that
    makes the table's rows gets those values."""
    built = build_model(TiedLayers, seed=0, table_values=False)
    assert built.model.category.weight.is_meta
    np.random.seed(0)
    torch.manual_seed(0)
    whole = TiedLayers()
    made = built.inits["category.weight"].rows(torch.arange(12))
    assert torch.equal(made, whole.category.weight.detach())


ZERO_STEPS = 2  # steps with no gradient at the end: the servers' model is then the one computed


def trained_and_seen(
    model_fn: Callable[[], nn.Module],
    batches: Callable[[int], Iterator],
    config: ps.TrainConfig,
) -> tuple[ps.TrainResult, dict[str, Tensor], Tensor, tuple[Tensor, ...]]:
    """A job whose trainers end with steps that change nothing, so that the model the job
    returns is the one they last computed with: the chief's dense values then, and its output
    on the last batch (in training mode, as computed), and its buffers then (batch norm's
    running statistics: the chief's are the model's)."""
    seen: dict[str, Any] = {}

    def loop(ctx: Any) -> None:
        data = list(batches(ctx.rank))
        probe = data[-1]
        for inputs, target in ctx.batches(data + [probe] * ZERO_STEPS):
            output = ctx.model(*inputs)
            loss = mse(output, target)
            weight = 0.0 if ctx.steps >= len(data) else 1.0
            (loss * weight).backward()
            ctx.step(loss.detach(), samples=int(target.shape[0]))
            if ctx.rank == 0:
                seen["output"], seen["inputs"] = output.detach().clone(), inputs
        if ctx.rank == 0:
            seen["dense"] = {n: p.detach().clone() for n, p in ctx.model.named_parameters()}
            seen["dense"].update({n: b.clone() for n, b in ctx.model.state_dict().items()
                                  if n not in seen["dense"] and n in initial_state})  # fmt: skip

    initial_state = initial_model(model_fn, seed=0).state_dict()
    result = ps.run(model_fn, loop, config)
    assert result is not None and result.model is not None
    return result, seen["dense"], seen["output"], seen["inputs"]


@pytest.mark.system
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_returned_exported_and_served_model_is_the_one_trainers_computed_with(
    name: str, mode: str, tmp_path: Path
) -> None:
    from paramserver.checkpoint.export import export_checkpoint
    from paramserver.checkpoint.store import load_latest

    model_fn, batches = MODELS[name]
    config = ps.TrainConfig(
        # Async: one trainer, or another's updates could land after the chief's last step.
        servers=2, trainers=2 if mode == "sync" else 1, mode=mode, optimizer="adagrad", lr=0.05,
        launcher="threads",
        progress=False, checkpoint_dir=str(tmp_path / "ckpt"),
    )  # fmt: skip
    result, dense, output, inputs = trained_and_seen(model_fn, batches, config)
    model = result.model
    got = {key: value.clone() for key, value in model.state_dict().items()}
    for key, value in dense.items():  # the chief's dense parameters and buffers
        assert torch.equal(got[key], value), key
    initial = initial_model(model_fn, seed=0).state_dict()
    assert any(not torch.equal(got[k], initial[k]) for k in plan_of(model, 1).tables)
    buffers = plan_of(model, 1).buffers
    assert all(not torch.equal(got[k], initial[k]) for k in buffers), "statistics never moved"
    model.train()
    torch.testing.assert_close(model(*inputs), output, rtol=1e-5, atol=1e-6)
    model.load_state_dict(got)  # a training-mode forward moves batch norm's statistics

    found = load_latest(tmp_path / "ckpt")
    assert found is not None and found.meta.get("final")
    export_checkpoint(found, tmp_path / "model.pt")
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(exported) == set(got)
    for key, value in got.items():
        assert torch.equal(exported[key], value), key

    model.eval()
    with torch.no_grad():
        expected = model(*inputs).numpy()
    serving = ps.serve(
        model_fn, base=tmp_path / "model.pt", example_inputs=list(inputs), http_port=0,
        grpc_port=None,
    )  # fmt: skip
    try:
        client = triton_http.InferenceServerClient(f"127.0.0.1:{serving.http_port}")
        given = []
        specs = client.get_model_metadata("model")["inputs"]
        for spec, tensor in zip(specs, inputs, strict=True):
            values = tensor.numpy()
            kind = np_to_triton_dtype(values.dtype)
            infer_input = triton_http.InferInput(spec["name"], list(values.shape), kind)
            infer_input.set_data_from_numpy(values)
            given.append(infer_input)
        answer = client.infer("model", given)
        assert np.array_equal(answer.as_numpy("output"), expected)
    finally:
        serving.close()
