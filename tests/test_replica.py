"""The trainer replica: remote embeddings behave like the modules they replace."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from paramserver import native
from paramserver.errors import InvalidBatchError, ModelError
from paramserver.modelplan import plan_of
from paramserver.trainer.replica import Call, MissingRows, Replica
from paramserver.wire.bundles import joined_already
from tests.helpers import counted


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
    """In a record pass, and where the lookups are derived from the inputs (checked once
    they are sorted unique), below the table and past it."""
    replica = Replica(nn.Sequential(nn.Embedding(10, 2)))
    with pytest.raises(InvalidBatchError, match=r"table 0\.weight: id 10 out of range \[0, 10\)"):
        replica.record_ids([(torch.tensor([1, 10]),)])
    for _ in range(2):  # learns the lookups are the inputs
        replica.record_ids([(torch.tensor([1, 9]),)])
    for bad, ids in ((10, [3, 10, 1]), (-2, [3, -2, 1])):
        with pytest.raises(InvalidBatchError, match=rf"id {bad} out of range \[0, 10\)"):
            replica.record_ids([(torch.tensor(ids),)])
        assert replica.inputs.derived
    with pytest.raises(InvalidBatchError, match="must be int64 or int32"):  # recorded: not ids
        replica.record_ids([(torch.tensor([1.0, 2.0]),)])


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
    replica.inputs.unknowable = True  # record passes throughout, not lookups derived
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


class _ManyLookups(nn.Module):
    """Tables of each kind of lookup: plain ones, one looked up twice, one whose output is
    changed in place, one of another width, a padding row, a bag; and in training a lookup the
    record pass (eval mode) does not see, whose ids were not pulled."""

    def __init__(self) -> None:
        super().__init__()
        self.twice = nn.Embedding(30, 4)
        self.in_place = nn.Embedding(30, 4)
        self.wide = nn.Embedding(30, 6)
        self.padded = nn.Embedding(30, 4, padding_idx=0)
        self.bag = nn.EmbeddingBag(30, 4, mode="sum")
        self.unseen = nn.Embedding(31, 4)

    def forward(self, x: Tensor) -> Tensor:
        changed = self.in_place(x[:, 1])
        changed.mul_(2.0)
        out = self.twice(x[:, 0]) + self.twice(x[:, 2]) + changed + self.padded(x[:, 1])
        out = out + self.bag(x) + self.unseen(x[:, 0])
        if self.training:
            out = out + self.unseen(x[:, 0] + 1)
        return out.sum(1) * self.wide(x[:, 2]).sum(1)


def _train_step(model: nn.Module, inputs: Tensor, upstream: Tensor) -> tuple[Tensor, Replica]:
    """One step of ``model`` made remote the way a trainer makes it: record, load the rows
    pulled (from the model's own weights), forward (reading rows a lookup missed), backward."""
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    replica = Replica(model)
    call = Call.of(inputs)
    recorded = replica.record([call])
    pulled = {name: (ids, weights[name][ids].clone()) for name, ids in recorded.ids.items()}
    replica.load({}, pulled, {}, recorded.lookups)

    def fetch(wanted: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
        return {name: (ids, weights[name][ids].clone()) for name, ids in wanted.items()}

    output = replica.forward_fetching(call, fetch)
    (output * upstream).sum().backward()
    return output, replica


def test_a_steps_lookups_made_in_one_node_are_the_modules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the compiled loops, a forward's recorded plain lookups are made in one autograd
    node: outputs and row gradients bitwise those of a node per lookup (the loops off; a table
    looked up twice sums its lookups' gradients in another order), and close to the module's
    own. Lookups of other kinds and lookups the record pass missed are made as before, in the
    same forward. The joined tables' gradients lie in one buffer, which a push sends without
    joining them again."""
    if native.loops is None:
        pytest.skip("the compiled loops are turned off (PARAMSERVER_NATIVE=0)")
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, 30, (64, 3), generator=g)
    upstream = torch.randn(64, generator=g)
    torch.manual_seed(0)
    module = _ManyLookups()
    state = module.state_dict()
    expected = module(inputs)
    (expected * upstream).sum().backward()
    gathers = counted(monkeypatch, "gather_rows")
    output, joined = _train_step(copy.deepcopy(module), inputs, upstream)
    assert gathers[0] == 4  # two widths, in the forward that missed rows and in its rerun
    monkeypatch.setattr(native, "loops", None)
    separate_output, separate = _train_step(copy.deepcopy(module), inputs, upstream)
    assert torch.equal(output, separate_output)
    torch.testing.assert_close(output, expected)
    _, rows = joined.gradients()
    _, separate_rows = separate.gradients()
    assert rows.keys() == separate_rows.keys() == set(state)
    for name, (ids, grads) in rows.items():
        assert torch.equal(ids, separate_rows[name][0])
        if name == "twice.weight":  # two lookups' gradients, summed in another order
            torch.testing.assert_close(grads, separate_rows[name][1], rtol=1e-6, atol=0)
        else:
            assert torch.equal(grads, separate_rows[name][1]), name
        module_grad = dict(module.named_parameters())[name].grad
        assert module_grad is not None
        torch.testing.assert_close(grads, module_grad[ids])
    one_buffer = [rows[f"{name}.weight"][1] for name in ("twice", "in_place")]
    assert joined_already(one_buffer) is not None  # "unseen" missed rows: on its own since


def test_lookups_in_one_node_keep_float32_rows_whatever_the_default_dtype() -> None:
    """The node's rows and gradients are float32 like the pulled rows, also where a program
    has set torch's default dtype to another."""
    module = nn.Embedding(10, 3)
    torch.set_default_dtype(torch.float64)
    try:
        output, replica = _train_step(module, torch.tensor([1, 2, 2]), torch.ones(3, 3))
    finally:
        torch.set_default_dtype(torch.float32)
    weight = module.weight.detach()
    assert output.dtype == torch.float32 and torch.equal(output, weight[[1, 2, 2]])
    _, rows = replica.gradients()
    assert torch.equal(rows["weight"][1], torch.tensor([[1.0] * 3, [2.0] * 3]))
