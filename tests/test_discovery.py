"""Lookups derived from a call's inputs give the record pass's ids on every model of the suite,
and record passes come back where the inputs do not tell."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from paramserver.data.synthetic import SyntheticClickLogs, SyntheticSpec
from paramserver.models import DLRM, RatingModel
from paramserver.trainer.discovery import Derivation, call_tensors, derivation_of
from paramserver.trainer.loop import trainer_model
from paramserver.trainer.replica import Call, Replica
from tests.field_models import (
    SharedItemTable,
    TiedLayers,
    shared_item_batches,
    tied_layer_batches,
)
from tests.helpers import (
    HashedModel,
    TinyRecModel,
    TwoTaskModel,
    hashed_batches,
    tiny_batches,
    two_task_batches,
)


def dlrm_calls() -> Iterator[tuple[Tensor, ...]]:
    logs = SyntheticClickLogs(SyntheticSpec(num_tables=3, rows_per_table=50, batch_size=16))
    for inputs, _ in logs.train_batches(0, 1):
        yield inputs


def rating_calls() -> Iterator[tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        sparse = torch.stack(
            [torch.randint(0, n, (8,), generator=g) for n in (30, 40, 2, 21, 7)], dim=1
        )
        yield torch.randn(8, 20, generator=g), sparse


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], Iterator[Any]]]] = {
    "tiny rec": (TinyRecModel, lambda: (b for b, _ in tiny_batches(0))),
    "hashed, dynamic": (lambda: HashedModel(True), lambda: (b for b, _ in hashed_batches(0))),
    "hashed, fixed": (lambda: HashedModel(False), lambda: (b for b, _ in hashed_batches(0))),
    "two task": (
        TwoTaskModel,
        lambda: ((b["user"], b["items"], b["dense"]) for b in two_task_batches(0)),
    ),
    "dlrm": (lambda: DLRM(table_rows=[50] * 3, embedding_dim=4), dlrm_calls),
    "rating": (lambda: RatingModel([30, 40, 2, 21, 7], 20), rating_calls),
    "shared item table": (SharedItemTable, lambda: (b for b, _ in shared_item_batches(0))),
    "tied layers": (TiedLayers, lambda: (b for b, _ in tied_layer_batches(0))),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_derived_lookups_are_the_record_passes(name: str) -> None:
    model_fn, calls = MODELS[name]
    recording = Replica(trainer_model(model_fn, 0))
    recording.inputs.unknowable = True
    deriving = Replica(trainer_model(model_fn, 0))
    for inputs in islice(calls(), 6):
        call = [Call.of(inputs)]
        expected, got = recording.record(call), deriving.record(call)
        assert expected.ids.keys() == got.ids.keys()
        for table, ids in expected.ids.items():
            assert torch.equal(ids, got.ids[table]), table
            each = [(a.tolist(), p.tolist()) for a, p in expected.lookups[table].each]
            assert each == [(a.tolist(), p.tolist()) for a, p in got.lookups[table].each]
    assert deriving.inputs.derived, "the inputs should have told (two passes agree)"


class ComputedIds(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(20, 2)

    def forward(self, ids: Tensor) -> Tensor:
        return self.table(ids % 10)  # not a view of an input


class EitherInput(nn.Module):
    """Looks up ``a`` or ``b`` depending on the data: derivable until the data says otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(20, 2)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return self.table(a if int(a[0]) < 10 else b)


def test_ids_computed_from_an_input_are_recorded() -> None:
    replica = Replica(ComputedIds())
    for _ in range(3):
        ids = replica.record_ids([(torch.tensor([3, 14, 15]),)])["table.weight"]
        assert ids.tolist() == [3, 4, 5]
    assert replica.inputs.unknowable and not replica.inputs.derived


def test_a_forward_that_looks_up_other_ids_than_derived_brings_record_passes_back() -> None:
    module = EitherInput()
    weight = module.table.weight.detach().clone()
    replica = Replica(module)
    low = (torch.tensor([1, 2]), torch.tensor([11, 12]))
    replica.record_ids([low])
    replica.record_ids([low])
    assert replica.inputs.derived
    high = (torch.tensor([15, 2]), torch.tensor([7, 8]))
    ids = replica.record_ids([high])["table.weight"]  # derived: a's ids, but b is looked up
    assert ids.tolist() == [2, 15]
    replica.load({}, {"table.weight": (ids, weight[ids].clone())})

    def fetch(wanted: dict[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
        return {t: (i, weight[i].clone()) for t, i in wanted.items()}

    output = replica.forward_fetching(Call(high), fetch)
    assert torch.equal(output, weight[torch.tensor([7, 8])])  # the right rows all the same
    assert replica.inputs.unknowable and not replica.inputs.derived
    assert replica.record_ids([high])["table.weight"].tolist() == [7, 8]  # recorded again


def test_a_view_of_an_input_is_found_by_its_geometry() -> None:
    sparse = torch.arange(12).view(4, 3)
    inputs = call_tensors((torch.randn(4), sparse, [sparse.T.contiguous()]), {})
    assert list(inputs) == [("arg", 1), ("arg", 2, 0)]
    assert derivation_of("t", sparse[:, 2], inputs) == Derivation("t", ("arg", 1), 1, 2)
    assert derivation_of("t", sparse[1], inputs) == Derivation("t", ("arg", 1), 0, 1)
    assert derivation_of("t", sparse, inputs) == Derivation("t", ("arg", 1))
    assert derivation_of("t", inputs[("arg", 2, 0)][1], inputs) == Derivation(
        "t", ("arg", 2, 0), 0, 1
    )
    assert derivation_of("t", sparse[1:, 0], inputs) is None  # a part of a column
    assert derivation_of("t", sparse[:, 0] + 0, inputs) is None  # a copy
