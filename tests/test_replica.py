"""The trainer replica: remote embeddings behave like the modules they replace."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from paramserver.errors import InvalidBatchError, ModelError
from paramserver.modelplan import plan_of
from paramserver.trainer.replica import Call, MissingRows, Replica


def run_remote(module: nn.Module, *inputs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Output and row gradients of ``module`` made remote, and the touched ids."""
    reference_weight = module.weight.detach().clone()  # type: ignore[union-attr]
    replica = Replica(module)
    ids = replica.record_ids([inputs])["weight"]
    replica.load({}, {"weight": (ids, reference_weight[ids].clone())})
    output = replica.forward(inputs)
    output.sum().backward()
    _, rows = replica.gradients()
    return output, rows["weight"][1], rows["weight"][0]


CASES = {
    "embedding": (lambda: nn.Embedding(20, 3), lambda: (torch.tensor([[1, 5], [5, 19]]),)),
    "embedding padding": (
        lambda: nn.Embedding(20, 3, padding_idx=5),
        lambda: (torch.tensor([1, 5, 5, 7]),),
    ),
    "embedding grad by freq": (
        lambda: nn.Embedding(20, 3, scale_grad_by_freq=True),
        lambda: (torch.tensor([1, 1, 1, 7]),),
    ),
    "bag sum 2d": (
        lambda: nn.EmbeddingBag(20, 3, mode="sum"),
        lambda: (torch.tensor([[1, 2, 2], [4, 19, 0]]),),
    ),
    "bag mean offsets": (
        lambda: nn.EmbeddingBag(20, 3, mode="mean"),
        lambda: (torch.tensor([3, 4, 4, 9, 11]), torch.tensor([0, 2, 2])),
    ),
    "bag max": (
        lambda: nn.EmbeddingBag(20, 3, mode="max"),
        lambda: (torch.tensor([[3, 8], [8, 1]]),),
    ),
    "bag weights": (
        lambda: nn.EmbeddingBag(20, 3, mode="sum"),
        lambda: (torch.tensor([3, 4, 9]), torch.tensor([0, 1]), torch.tensor([0.5, 2.0, -1.0])),
    ),
    "bag last offset": (
        lambda: nn.EmbeddingBag(20, 3, mode="sum", include_last_offset=True),
        lambda: (torch.tensor([3, 4, 9]), torch.tensor([0, 1, 3])),
    ),
    "bag padding": (
        lambda: nn.EmbeddingBag(20, 3, mode="mean", padding_idx=0),
        lambda: (torch.tensor([[0, 2, 3], [0, 0, 5]]),),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_remote_embedding_matches_the_module_it_replaces(case: str) -> None:
    make_module, make_inputs = CASES[case]
    torch.manual_seed(0)
    original = make_module()
    inputs = make_inputs()
    expected = original(*inputs)
    expected.sum().backward()
    dense_grad = original.weight.grad
    assert dense_grad is not None
    output, row_grads, ids = run_remote(original, *inputs)
    torch.testing.assert_close(output, expected)
    torch.testing.assert_close(row_grads, dense_grad[ids])
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[ids] = False
    assert bool((dense_grad[untouched] == 0).all()), "rows outside the batch must get no gradient"


def test_a_plain_lookups_rows_and_gradients_are_bitwise_the_modules() -> None:
    """A plain lookup (no padding row, no scaling by frequency) is made with index_select, not
    F.embedding: its output and its rows' gradients are bitwise the module's, repeated ids'
    gradients summed alike."""
    g = torch.Generator().manual_seed(0)
    module = nn.Embedding(50, 8)
    inputs = torch.randint(0, 50, (64, 7), generator=g)
    upstream = torch.randn(64, 7, 8, generator=g) * 1e3
    (module(inputs) * upstream).sum().backward()
    weight = module.weight.detach().clone()
    replica = Replica(module)
    ids = replica.record_ids([(inputs,)])["weight"]
    replica.load({}, {"weight": (ids, weight[ids].clone())})
    output = replica.forward((inputs,))
    (output * upstream).sum().backward()
    _, rows = replica.gradients()
    assert torch.equal(output, weight[inputs])
    assert module.weight.grad is not None
    assert torch.equal(rows["weight"][1], module.weight.grad[ids])


def test_max_norm_and_tied_weights_are_refused() -> None:
    with pytest.raises(ModelError, match="max_norm"):
        Replica(nn.Embedding(10, 2, max_norm=1.0))

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 2)
            self.out = nn.Linear(2, 10, bias=False)
            self.out.weight = self.emb.weight

    with pytest.raises(ModelError, match="tied"):
        Replica(Tied())


def test_out_of_range_ids_are_a_clear_error() -> None:
    replica = Replica(nn.Sequential(nn.Embedding(10, 2)))
    with pytest.raises(InvalidBatchError, match=r"table 0\.weight: id 10 out of range \[0, 10\)"):
        replica.record_ids([(torch.tensor([1, 10]),)])


class SharedLookups(nn.Module):
    """One table looked up twice; the second lookup's ids come from a later input."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Embedding(30, 2)
        self.second = nn.Embedding(30, 2)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        x = self.first(a) + self.second(a)
        return x + self.first(b)


def test_lookups_the_record_pass_skipped_are_fetched_not_wrong() -> None:
    model = SharedLookups()
    weights = {
        "first.weight": model.first.weight.detach().clone(),
        "second.weight": model.second.weight.detach().clone(),
    }
    replica = Replica(model)
    batch = (torch.tensor([1, 2]), torch.tensor([3, 4]))
    replica.record_ids([batch])  # learns: first twice, second once
    replica.record_ids([batch])
    # A later record pass stops once it has seen the lookups it expects; simulate a pass that
    # learned a smaller count, so the last lookup of `first` is missed.
    replica._lookups_per_forward = {"first.weight": 1, "second.weight": 1}
    ids = replica.record_ids([batch])
    assert ids["first.weight"].tolist() == [1, 2]
    replica.load({}, {n: (i, weights[n][i].clone()) for n, i in ids.items()})
    with pytest.raises(MissingRows) as missing:
        replica.forward(batch)
    assert missing.value.ids.tolist() == [3, 4]
    extra = missing.value.ids
    replica.add_rows("first.weight", extra, weights["first.weight"][extra].clone())
    torch.testing.assert_close(
        replica.forward(batch),
        weights["first.weight"][[1, 2]]
        + weights["second.weight"][[1, 2]]
        + weights["first.weight"][[3, 4]],
    )


def test_plan_names_tables_and_dense_parameters_by_state_dict_name() -> None:
    model = nn.ModuleDict(
        {"emb": nn.Embedding(10, 4), "bag": nn.EmbeddingBag(7, 4), "lin": nn.Linear(4, 2)}
    )
    plan = plan_of(model, num_servers=2)
    assert set(plan.tables) == {"emb.weight", "bag.weight"}
    assert set(plan.dense) == {"lin.weight", "lin.bias"}
    assert set(plan.dense) | set(plan.tables) == set(model.state_dict())


def test_a_model_without_tables_runs_no_record_pass() -> None:
    """Recording would run its whole forward for nothing: every step, an extra forward."""
    calls = []
    model = nn.Linear(4, 1)
    model.register_forward_hook(lambda *args: calls.append(1))
    replica = Replica(model)
    assert replica.record_ids([torch.ones(2, 4)]) == {}
    assert calls == []


def recorded_replica(model: nn.Module, batch: tuple[Tensor, ...]) -> tuple[Replica, Tensor]:
    """A replica of ``model`` with the rows ``batch`` looks up loaded, with its record pass's
    lookups; and the table's weight (``model`` has one table, ``weight``)."""
    weight = model.weight.detach().clone()  # type: ignore[union-attr]
    replica = Replica(model)
    recorded = replica.record([Call.of(batch)])
    ids = recorded.ids["weight"]
    replica.load({}, {"weight": (ids, weight[ids].clone())}, lookups=recorded.lookups)
    return replica, weight


def test_a_forward_making_the_recorded_lookup_takes_its_positions_from_the_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch = (torch.tensor([[7, 3], [3, 11]]),)
    replica, weight = recorded_replica(nn.Embedding(20, 3), batch)
    monkeypatch.setattr(torch, "searchsorted", None)  # a search would fail: none is made
    torch.testing.assert_close(replica.forward(batch), weight[batch[0]])
    # the same ids in another tensor (as a loop that rebuilds its inputs) are recognised too
    torch.testing.assert_close(replica.forward((batch[0].clone(),)), weight[batch[0]])


def test_a_batch_changed_after_its_record_pass_is_looked_up_anew() -> None:
    batch = (torch.tensor([7, 3, 11]),)
    replica, weight = recorded_replica(nn.Embedding(20, 3), batch)
    batch[0][0] = 11  # rows of 3 and 11 were pulled; the record's positions are now wrong
    torch.testing.assert_close(replica.forward(batch), weight[[11, 3, 11]])
    batch[0][0] = 5  # a row not pulled: fetched, not read from a wrong position
    with pytest.raises(MissingRows) as missing:
        replica.forward(batch)
    assert missing.value.ids.tolist() == [5]
