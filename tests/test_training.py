"""End-to-end training through the Python API (threads launcher): learning, clipping,
accumulation, traffic, and errors reaching the user."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import paramserver as ps
from paramserver.baseline import train_single_process
from paramserver.data.synthetic import SyntheticClickLogs, SyntheticSpec
from paramserver.launch.roles import build_server
from paramserver.metrics import evaluate_binary
from paramserver.modelplan import initial_model
from paramserver.models.dlrm import DLRM
from paramserver.trainer.loop import default_loop, run_trainer, trainer_model
from paramserver.transport.local import LocalTransport
from paramserver.wire.sizing import payload_nbytes
from tests.helpers import TinyRecModel, mse, nan_loss, tiny_batches

pytestmark = pytest.mark.system  # starts processes or whole jobs: the system tier


@pytest.mark.timeout(300)
def test_async_two_trainers_learn_as_well_as_single_process_on_the_default_job() -> None:
    """The default job (its data, model and TrainConfig), run as separate processes."""
    data = SyntheticClickLogs(SyntheticSpec())
    config = ps.TrainConfig(progress=False)
    assert (config.mode, config.trainers, config.launcher) == ("async", 2, "auto")
    result = ps.train(DLRM, data.train_batches, F.binary_cross_entropy_with_logits, config)
    assert result is not None
    held_out = [batch for batch, _ in data.eval_batches()]
    distributed = evaluate_binary(result.model, held_out)["auc"]
    reference, _ = train_single_process(
        DLRM, data.train_batches, F.binary_cross_entropy_with_logits, config
    )
    single = evaluate_binary(reference, held_out)["auc"]
    untrained = evaluate_binary(initial_model(DLRM, 0), held_out)["auc"]
    assert single > untrained + 0.2, "the reference did not learn: the comparison is vacuous"
    assert abs(distributed - single) <= 0.01, (distributed, single)


def reference_sgd(batches_per_step: int, clip: float | None, steps: int) -> dict[str, Any]:
    """Single process, plain SGD (lazy and dense updates agree for SGD without momentum)."""
    model = initial_model(TinyRecModel, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    stream = tiny_batches(0, num_batches=steps * batches_per_step)
    for _ in range(steps):
        optimizer.zero_grad()
        for _ in range(batches_per_step):
            inputs, target = next(stream)
            (mse(model(*inputs), target) / batches_per_step).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize(("accumulate", "clip"), [(1, 0.05), (3, None), (2, 0.1)])
def test_clipping_and_accumulation_match_single_process(
    accumulate: int, clip: float | None
) -> None:
    steps = 5
    config = ps.TrainConfig(
        servers=2,
        trainers=1,
        mode="sync",
        optimizer="sgd",
        lr=0.5,
        accumulate=accumulate,
        clip_grad_norm=clip,
        launcher="threads",
        progress=False,
    )
    data = lambda t, n: tiny_batches(t, num_batches=steps * accumulate)  # noqa: E731
    result = ps.train(TinyRecModel, data, mse, config)
    assert result is not None
    assert result.summary["trainer_steps"] == [steps]
    expected = reference_sgd(accumulate, clip, steps)
    unclipped = reference_sgd(accumulate, None, steps)
    for name, value in expected.items():
        torch.testing.assert_close(result.model.state_dict()[name], value, msg=name)
    if clip is not None:
        assert any(not torch.allclose(expected[n], unclipped[n]) for n in expected), (
            "clipping never engaged: the test is vacuous"
        )


def test_a_last_short_step_of_accumulated_batches_is_pushed_as_their_mean() -> None:
    """Seven batches, three a step: the last step holds one batch, and its push is that
    batch's gradient, as a single process averaging over the batches it has would do."""
    config = ps.TrainConfig(
        servers=2, trainers=1, mode="sync", optimizer="sgd", lr=0.5, accumulate=3,
        launcher="threads", progress=False,
    )  # fmt: skip
    result = ps.train(TinyRecModel, lambda t, n: tiny_batches(t, num_batches=7), mse, config)
    assert result is not None and result.model is not None
    assert result.summary["trainer_steps"] == [3]
    model = initial_model(TinyRecModel, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = list(tiny_batches(0, num_batches=7))
    for group in (batches[0:3], batches[3:6], batches[6:]):
        optimizer.zero_grad()
        for inputs, target in group:
            (mse(model(*inputs), target) / len(group)).backward()
        optimizer.step()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(result.model.state_dict()[name], value, msg=name)


class RecordingTransport(LocalTransport):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.pulled_per_call: list[int] = []

    def call(
        self, server: int, op: str, *args: Any, timeout_s: float | None = None
    ) -> torch.futures.Future:
        future = super().call(server, op, *args)
        if op == "push_pull":
            self.pulled_per_call.append(payload_nbytes(future.wait()))
        return future


def test_pulls_only_the_rows_a_step_touches() -> None:
    servers, steps = 2, 6
    config = ps.TrainConfig(servers=servers, trainers=1, launcher="threads", progress=False)
    transport = RecordingTransport([build_server(s, config, TinyRecModel) for s in range(servers)])
    loop = default_loop(lambda t, n: tiny_batches(t, num_batches=steps), mse, epochs=1)
    run_trainer(0, config, TinyRecModel, loop, transport)
    model = TinyRecModel()
    dense_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if "mlp" in n)
    row_bytes = 4 * 4
    # Prefetching, the rows the step before also touched come with their optimizer state
    # (see tests/test_ownupdates.py), Adagrad's sum, and so do the dense values, with their
    # count of updates, from the second call on.
    state_bytes = transport.endpoints[0].shard.store.tables["user.weight"].arena.state_row_nbytes()
    assert state_bytes == row_bytes
    per_step = [
        sum(transport.pulled_per_call[i * servers : (i + 1) * servers]) for i in range(steps)
    ]
    before: list[Tensor] = [torch.empty(0, dtype=torch.int64)] * 2
    for step, (inputs, _) in enumerate(tiny_batches(0, num_batches=steps)):
        touched = [inputs[0].unique(), inputs[1].unique()]
        unique_rows = sum(ids.numel() for ids in touched)
        pairs = zip(touched, before, strict=True)
        again = sum(int(torch.isin(now, then).sum()) for now, then in pairs)
        before = touched
        dense_state_bytes = (dense_bytes + 4 * 4) if step else 0
        state = again * state_bytes + dense_state_bytes
        needed = unique_rows * row_bytes + dense_bytes + state
        assert per_step[step] <= 1.1 * unique_rows * row_bytes + dense_bytes + state
        assert per_step[step] >= needed  # and nothing is missing
    whole_tables = (40 + 30) * row_bytes
    assert max(per_step) < dense_bytes + whole_tables


def test_uneven_data_in_sync_mode_finishes_and_counts_every_step() -> None:
    config = ps.TrainConfig(servers=2, trainers=3, mode="sync", launcher="threads", progress=False)
    lengths = {0: 7, 1: 3, 2: 0}
    result = ps.train(
        TinyRecModel, lambda t, n: tiny_batches(t, num_batches=lengths[t]), mse, config
    )
    assert result is not None
    assert result.summary["trainer_steps"] == [7, 3, 0]
    assert result.summary["samples"] == 10 * 6


def test_steps_and_epochs_bound_the_job() -> None:
    config = ps.TrainConfig(
        servers=1, trainers=2, launcher="threads", epochs=3, steps=8, progress=False
    )
    result = ps.train(TinyRecModel, lambda t, n: tiny_batches(t, num_batches=3), mse, config)
    assert result is not None
    assert result.summary["trainer_steps"] == [8, 8]


def test_any_re_iterable_of_batches_is_shared_round_robin_every_epoch() -> None:
    batches = list(tiny_batches(0, num_batches=7))
    config = ps.TrainConfig(
        servers=2, trainers=2, mode="sync", launcher="threads", epochs=2, progress=False
    )
    from_list = ps.train(TinyRecModel, batches, mse, config)
    by_hand = ps.train(TinyRecModel, lambda t, n: batches[t::n], mse, config)
    assert from_list is not None and by_hand is not None
    assert from_list.summary["trainer_steps"] == [8, 6]  # 4 + 4 and 3 + 3 over two epochs
    for (name, a), (_, b) in zip(
        from_list.model.state_dict().items(), by_hand.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    loader = torch.utils.data.DataLoader(batches, batch_size=None)  # in order: shared as is
    from_loader = ps.train(TinyRecModel, loader, mse, config)
    assert from_loader is not None and from_loader.summary["trainer_steps"] == [8, 6]
    shuffled = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=True)
    with pytest.raises(TypeError, match="shuffles"):
        ps.train(TinyRecModel, shuffled, mse, config)
    with pytest.raises(TypeError, match="one-pass iterator"):
        ps.train(TinyRecModel, (b for b in batches), mse, config)
    with pytest.raises(TypeError, match="iterable of batches"):
        ps.train(TinyRecModel, 3, mse, config)  # type: ignore[arg-type]


def test_bad_data_reaches_the_user_as_a_typed_error() -> None:
    def data(trainer: int, num_trainers: int) -> Any:
        for i, ((user, items, dense), target) in enumerate(tiny_batches(trainer)):
            if trainer == 1 and i == 2:
                user = user + 1000
            yield (user, items, dense), target

    config = ps.TrainConfig(servers=2, trainers=2, launcher="threads", progress=False)
    with pytest.raises(
        ps.JobFailedError,
        match=r"trainer 1 failed: InvalidBatchError: table "
        r"user\.weight: id 10\d\d out of range",
    ):
        ps.train(TinyRecModel, data, mse, config)


def test_nan_gradients_are_rejected_and_reach_the_user() -> None:
    config = ps.TrainConfig(servers=2, trainers=1, launcher="threads", progress=False)
    with pytest.raises(ps.JobFailedError, match="InvalidPushError.*NaN or Inf"):
        ps.train(TinyRecModel, lambda t, n: tiny_batches(t, num_batches=3), nan_loss, config)


def test_result_model_is_a_plain_module_that_loads_without_paramserver() -> None:
    config = ps.TrainConfig(servers=2, trainers=2, launcher="threads", progress=False)
    result = ps.train(TinyRecModel, lambda t, n: tiny_batches(t, num_batches=4), mse, config)
    assert result is not None
    assert isinstance(result.model.user, nn.Embedding)
    fresh = TinyRecModel()
    fresh.load_state_dict(result.model.state_dict())
    keys = {"steps", "samples", "samples_per_s", "train_loss", "wall_s", "bytes"}
    assert keys <= set(result.summary)
    assert (
        result.summary["bytes"]["trainers"]["sent"]
        == result.summary["bytes"]["servers"]["received"]
    )


def test_sync_mode_finishes_when_a_server_owns_nothing_a_trainer_touched() -> None:
    """Five servers for four dense parameters, one-row batches: some servers get no
    gradients from a trainer in a step, and their rounds must still close."""
    config = ps.TrainConfig(servers=5, trainers=2, mode="sync", launcher="threads", progress=False)
    result = ps.train(
        TinyRecModel, lambda t, n: tiny_batches(t, num_batches=6, batch=1), mse, config
    )
    assert result is not None
    assert result.summary["trainer_steps"] == [6, 6]


class WithBuffers(TinyRecModel):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        out = super().forward(*inputs)
        if self.training:
            self.calls += 1
        return out


def test_buffers_come_back_with_the_result() -> None:
    config = ps.TrainConfig(servers=2, trainers=1, launcher="threads", progress=False)
    result = ps.train(WithBuffers, lambda t, n: tiny_batches(t, num_batches=4), mse, config)
    assert result is not None
    assert float(result.model.calls) == 4  # record passes run in eval mode and do not count


class DrawnBuffer(TinyRecModel):
    """A buffer drawn from the RNG after the parameters: trainers, which build their model
    without values, must take it from the servers."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("noise", torch.randn(5))

    def forward(self, user: torch.Tensor, items: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return super().forward(user, items, dense + self.noise[:3])


def test_trainers_build_their_model_without_table_memory() -> None:
    model = trainer_model(TinyRecModel, seed=0)
    assert model.user.weight.is_meta and model.items.weight.is_meta
    assert not model.mlp[0].weight.is_meta

    def reads_a_table() -> nn.Module:
        model = TinyRecModel()
        model.user.weight[0, 0].item()  # needs values: the tables are built in memory
        return model

    assert not trainer_model(reads_a_table, seed=0).user.weight.is_meta

    class BufferFromATable(TinyRecModel):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("center", self.user.weight.detach().mean(0).clone())

    rebuilt = trainer_model(BufferFromATable, seed=0)  # the buffer needs the table's values
    assert not rebuilt.center.is_meta and not rebuilt.user.weight.is_meta
    # One trainer in sync mode: the same updates as one process, so the same parameters.
    config = ps.TrainConfig(servers=2, trainers=1, mode="sync", launcher="threads", progress=False)
    data = lambda t, n: tiny_batches(t, num_batches=4)  # noqa: E731
    result = ps.train(DrawnBuffer, data, mse, config)
    assert result is not None
    assert torch.equal(result.model.noise, initial_model(DrawnBuffer, 0).noise)
    reference, _ = train_single_process(DrawnBuffer, data, mse, config)
    for name, value in reference.state_dict().items():
        assert torch.allclose(result.model.state_dict()[name], value, atol=1e-5), name


def test_a_per_table_optimizer_for_a_missing_table_is_an_error() -> None:
    config = ps.TrainConfig(
        launcher="threads",
        progress=False,
        table_optimizers={"usr.weight": ps.OptimizerConfig(name="adam", lr=0.1)},
    )
    with pytest.raises(ps.ConfigError, match=r"usr\.weight"):
        ps.train(TinyRecModel, lambda t, n: tiny_batches(t, num_batches=2), mse, config)


def test_the_model_can_stay_on_the_servers() -> None:
    config = ps.TrainConfig(
        servers=2, trainers=1, launcher="threads", progress=False, gather_model=False
    )
    result = ps.train(TinyRecModel, lambda t, n: tiny_batches(t, num_batches=3), mse, config)
    assert result is not None and result.model is None
    assert result.summary["trainer_steps"] == [3]


def test_dlrms_interactions_are_the_dot_products_of_every_pair_of_vectors() -> None:
    """Its pairs, picked from the flattened matrix of dot products, are each pair (i < j) in
    the order rows-then-columns indexing gives: the same output and gradients, bitwise."""
    torch.manual_seed(0)
    model = DLRM(num_dense=13, table_rows=[50] * 5)
    dense, sparse = torch.randn(64, 13), torch.randint(0, 50, (64, 5))

    def by_rows_and_columns() -> torch.Tensor:
        bottom = model.bottom(dense)
        vectors = [bottom] + [table(sparse[:, i]) for i, table in enumerate(model.embeddings)]
        stacked = torch.stack(vectors, dim=1)
        rows, columns = torch.triu_indices(6, 6, offset=1)
        dots = torch.bmm(stacked, stacked.transpose(1, 2))[:, rows, columns]
        return model.top(torch.cat([bottom, dots], dim=1)).squeeze(1)

    results = []
    for forward in (lambda: model(dense, sparse), by_rows_and_columns):
        model.zero_grad(set_to_none=True)
        output = forward()
        output.sum().backward()
        results.append((output.detach(), [p.grad for p in model.parameters()]))
    (output, grads), (expected, expected_grads) = results
    assert torch.equal(output, expected)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads, strict=True))
