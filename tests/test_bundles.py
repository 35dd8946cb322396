"""Messages on the wire: each mapping of tensors of 16 KB or more travels as one bundle
(paramserver.wire.bundles' Bundle), arrives equal, and a spoiled bundle is refused with a typed
error that changes nothing, on a server and on a trainer. The tests of the bundles' own workings
bundle every mapping, whatever its size (``every_mapping_bundled``)."""

from __future__ import annotations

import dataclasses
import math
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from paramserver.errors import ParamServerError
from paramserver.store.arena import ROW_HELD, ROW_STEPS
from paramserver.trainer.client import PSClient
from paramserver.transport.local import LocalTransport
from paramserver.wire import bundles, frames
from paramserver.wire.bundles import (
    Bundle,
    MalformedBundle,
    MixedBundle,
    bundled,
    joined_already,
    unbundled,
)
from paramserver.wire.compression import Encoded, encode
from paramserver.wire.idcodec import PackedIds, compact_ids
from paramserver.wire.messages import (
    PushPullReply,
    PushPullRequest,
    RowBlock,
    RowBlocksBundle,
    state_key,
)
from paramserver.wire.sizing import message_sizes
from tests.helpers import MakeServer, own_ids

BUNDLED_FROM = bundles.BUNDLED_FROM


@pytest.fixture(autouse=True)
def every_mapping_bundled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundles, "BUNDLED_FROM", 0)


def test_a_mapping_under_16_kb_travels_in_the_frame_as_it_is(
    monkeypatch: pytest.MonkeyPatch, loop_mode: str
) -> None:
    """A frame copies small tensors into its data anyway: a bundle of them would copy them
    twice. From the size a tensor travels beside the frame, a mapping is one bundle."""
    monkeypatch.setattr(bundles, "BUNDLED_FROM", BUNDLED_FROM)
    assert BUNDLED_FROM == frames.LARGE_BYTES
    small = {"a": torch.randn(4, 16), "b": torch.randn(2, 16)}
    large = {name: value.repeat(64, 1) for name, value in small.items()}  # 24 KB
    assert bundled(small) is small
    assert type(bundled(large)) is Bundle
    for rows in (small, large):
        reply = PushPullReply(rows=rows)
        received = frames.decode(*frames.encode(reply))
        assert received.malformed() is None
        assert_same(received.rows, rows)


def tensors_in(item: Any) -> int:
    """How many tensors travel in ``item`` (what TensorPipe ships one buffer each)."""
    if isinstance(item, Tensor):
        return 1
    if isinstance(item, dict):
        item = list(item.values())
    elif dataclasses.is_dataclass(item) and not isinstance(item, type):
        item = [getattr(item, f.name) for f in dataclasses.fields(item)]
    elif not isinstance(item, list | tuple):
        return 0
    return sum(tensors_in(part) for part in item)


def assert_same(received: Any, sent: Any) -> None:
    """Equal tensors (values, dtype, shape) in the same structure."""
    if isinstance(sent, Tensor):
        assert type(received) is Tensor and received.dtype == sent.dtype
        assert received.shape == sent.shape and torch.equal(received, sent)
    elif isinstance(sent, dict):
        assert type(received) is dict and list(received) == list(sent)
        for name in sent:
            assert_same(received[name], sent[name])
    elif dataclasses.is_dataclass(sent):
        assert type(received) is type(sent)
        for f in dataclasses.fields(sent):
            assert_same(getattr(received, f.name), getattr(sent, f.name))
    elif isinstance(sent, tuple | list):
        assert len(received) == len(sent)
        for r, s in zip(received, sent, strict=True):
            assert_same(r, s)
    else:
        assert received == sent


def criteo_like_request() -> PushPullRequest:
    """Every shape a request's mappings take: many tables of one width (bundled as rows),
    dense gradients of mixed shapes (flattened), a 0-dim and an empty tensor."""
    g = torch.Generator().manual_seed(0)
    tables = [f"embeddings.{i}.weight" for i in range(26)]
    ids = {t: torch.randint(-(2**62), 2**62, (50 + i,), generator=g) for i, t in enumerate(tables)}
    ids[tables[3]] = torch.zeros(0, dtype=torch.int64)
    return PushPullRequest(
        trainer=1,
        call=7,
        dense_grads={
            "bottom.0.weight": torch.randn(64, 13, generator=g),
            "bottom.0.bias": torch.randn(64, generator=g),
            "top.scale": torch.randn((), generator=g),
        },
        row_grads={t: RowBlock(i, torch.randn(i.numel(), 16, generator=g)) for t, i in ids.items()},
        pull_rows={t: i + 1 for t, i in ids.items()},
        pull_versions={t: torch.full((i.numel(),), 3) for t, i in ids.items()},
        grads_call=6,
    )


def through_the_wire(message: Any) -> Any:
    return pickle.loads(pickle.dumps(message))


def test_a_requests_mappings_travel_as_a_few_tensors_and_arrive_equal(loop_mode: str) -> None:
    request = criteo_like_request()
    wire = request.__getstate__()
    assert type(wire["dense_grads"]) is Bundle and wire["dense_grads"].flat.dim() == 1
    assert type(wire["row_grads"]) is RowBlocksBundle
    assert type(wire["pull_rows"]) is Bundle and type(wire["pull_versions"]) is Bundle
    assert tensors_in(request) == 3 + 26 * 4 and tensors_in(wire) == 5
    received = through_the_wire(request)
    assert_same(received, request)
    assert received.malformed() is None
    # Views of one bundle count as the tensors they stand for: the servers' caps are unchanged.
    assert message_sizes(received) == message_sizes(request)


def test_an_answers_mappings_travel_as_a_few_tensors_and_arrive_equal(loop_mode: str) -> None:
    g = torch.Generator().manual_seed(1)
    reply = PushPullReply(
        dense={"a": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)},
        rows={f"t{i}": torch.randn(i, 8, generator=g) for i in range(5)},
        row_versions={"t1": torch.tensor([2]), "t2": torch.tensor([0, 5])},
        checkpoint_at=3,
        dense_versions={"a": 4, "b": 4},
    )
    assert tensors_in(reply.__getstate__()) == 3
    received = through_the_wire(reply)
    assert_same(received, reply)
    assert received.malformed() is None


def test_what_cannot_be_bundled_travels_as_it_is(loop_mode: str) -> None:
    """Encoded values, packed ids, a single tensor: each mapping as it was."""
    ids = torch.tensor([3, 5, 9])
    packed = compact_ids(ids)
    assert type(packed) is PackedIds
    request = PushPullRequest(
        trainer=0,
        call=1,
        dense_grads={"a": torch.ones(2), "b": encode("int8", torch.ones(2))},
        row_grads={
            "x": RowBlock(packed, torch.ones(3, 4)),
            "y": RowBlock(ids, encode("int8", torch.ones(3, 4))),
        },
        pull_rows={"x": ids},
    )
    wire = request.__getstate__()
    assert type(wire["dense_grads"]) is dict and type(wire["pull_rows"]) is dict
    assert type(wire["row_grads"]) is dict  # neither ids nor values are one plain dtype
    received = through_the_wire(request)
    assert type(received.row_grads["y"].values) is Encoded
    assert received.row_grads["x"].ids.first == packed.first
    assert torch.equal(received.row_grads["x"].ids.steps, packed.steps)
    assert torch.equal(received.dense_grads["a"], request.dense_grads["a"])
    assert type(received.dense_grads["b"]) is Encoded


def mixed_state() -> dict[str, Tensor]:
    """A mapping of 26 tables' float slots, int64 counts and bool masks, interleaved by
    table (as a row state by table would be)."""
    g = torch.Generator().manual_seed(2)
    state: dict[str, Tensor] = {}
    for i in range(26):
        rows = 3 + i % 4
        state[state_key(f"t{i}", "sum")] = torch.rand(rows, 16, generator=g)
        state[state_key(f"t{i}", ROW_STEPS)] = torch.randint(0, 9, (rows,), generator=g)
        if i % 3 == 0:
            state[state_key(f"t{i}", ROW_HELD)] = torch.rand(rows, generator=g) > 0.5
    return state


def test_a_mapping_of_several_dtypes_travels_as_one_tensor_per_dtype_in_its_order(
    loop_mode: str,
) -> None:
    state = mixed_state()
    reply = PushPullReply(dense_state=state)
    wire = reply.__getstate__()
    assert type(wire["dense_state"]) is MixedBundle and tensors_in(wire["dense_state"]) == 3
    received = through_the_wire(reply)
    assert received.malformed() is None
    assert_same(received.dense_state, state)  # names in the order sent, not grouped by dtype


def test_every_spoiled_bundle_of_several_dtypes_is_named_not_read(loop_mode: str) -> None:
    mixed = bundled(mixed_state())
    assert type(mixed) is MixedBundle
    names, (floats, ints, bools) = mixed.names, mixed.bundles
    wrongs = [
        MixedBundle(list(names), mixed.bundles),  # type: ignore[arg-type]
        MixedBundle(names, [floats, ints, bools]),  # type: ignore[arg-type]
        MixedBundle(names, (floats, ints, "bools")),  # type: ignore[arg-type]
        MixedBundle(names, (floats, ints)),  # names no bundle holds
        MixedBundle(names[:-1], mixed.bundles),  # a bundle holds a name not named
        MixedBundle((*names, names[0]), mixed.bundles),  # a name twice
        MixedBundle(names, (floats, ints, floats)),  # a bundle twice
        *(MixedBundle(names, (wrong, ints, bools)) for wrong in spoiled(floats)),
    ]
    for wrong in wrongs:
        found = unbundled(wrong)
        assert type(found) is MalformedBundle and found.reason.startswith("a bundle"), wrong


def spoiled(bundle: Bundle) -> list[Bundle]:
    """Bundles wrong in each way a peer could send (as rows, ``bundle.flat`` is 2-D)."""
    names, shapes, flat = bundle.names, bundle.shapes, bundle.flat
    first, *rest = shapes
    empty_rows = Bundle(names, tuple((2, 0) for _ in names), torch.zeros(len(names), 0))
    return [
        Bundle(list(names), shapes, flat),  # type: ignore[arg-type]  # names not a tuple
        Bundle((names[0], names[0], *names[2:]), shapes, flat),  # a name twice
        Bundle((names[0], 5, *names[2:]), shapes, flat),  # type: ignore[arg-type]
        Bundle(names, shapes, flat.sum()),  # 0-dim
        Bundle(names, shapes, flat.to_sparse()),
        Bundle(names, shapes, "values"),  # type: ignore[arg-type]
        Bundle(names, tuple(rest), flat),  # a shape missing
        Bundle(names, ((-1, *first[1:]), *rest), flat),
        Bundle(names, ((10**30, *first[1:]), *rest), flat),  # claims absurdly many
        Bundle(names, (list(first), *rest), flat),  # type: ignore[arg-type]
        Bundle(names, ((first[0], 2.0), *rest), flat),  # type: ignore[arg-type]
        Bundle(names, shapes, flat[:-1]),  # holds fewer values than claimed
        Bundle(names, shapes, torch.cat([flat, flat[:1]])),  # holds more
        empty_rows,  # no values either way, but other rows than claimed
        Bundle(names, ((True, *first[1:]), *rest), flat),  # a bool is not a size
        Bundle(names, ((-(10**30), *first[1:]), *rest), flat),
        Bundle(names, shapes, flat.double().requires_grad_(True)),  # not plain
    ]


def spoiled_flattened(bundle: Bundle) -> list[Bundle]:
    """Bundles of tensors of several shapes (flattened on the wire) wrong in each way."""
    names, shapes, flat = bundle.names, bundle.shapes, bundle.flat
    first, *rest = shapes
    return [
        Bundle(names, ((*first, 10**30), *rest), flat),  # claims absurdly many
        Bundle(names, ((10**30, 0), *rest), flat),  # no tensor has a size past int64
        Bundle(names, ((0, 10**30), *rest), flat[: flat.numel() - math.prod(first)]),
        Bundle(names, ((2**62, 0), *rest), flat),  # claims more before its 0: refused as it comes
        Bundle(names, ((0, 2**62), *rest), flat[math.prod(first) :]),  # fine: no values
        Bundle(names, ((2**62, 2**62, 4), *rest), flat),  # past int64 once multiplied
        Bundle(names, shapes, flat[:-1]),
        Bundle(names, shapes, torch.cat([flat, flat[:1]])),
    ]


def test_every_spoiled_bundle_is_named_not_read(loop_mode: str) -> None:
    """A peer's bundle wrong in any way is refused whole, in the same words whether the
    compiled loops or Python check it."""
    from paramserver.wire.bundles import _views

    rows = criteo_like_request().__getstate__()["row_grads"].values
    assert type(rows) is Bundle and rows.flat.dim() == 2
    flattened = bundled({"a": torch.ones(3000, 2), "b": torch.ones(7), "c": torch.ones(4, 5, 6)})
    assert type(flattened) is Bundle and flattened.flat.dim() == 1
    fine = 0
    for wrong in [*spoiled(rows), *spoiled_flattened(flattened)]:
        found = unbundled(wrong)
        python = _views(wrong.names, wrong.shapes, wrong.flat)
        if type(python) is dict:  # (the one fine case: a 0 before a large size)
            fine += 1
            assert type(found) is dict and found.keys() == python.keys()
            assert all(torch.equal(found[k], python[k]) for k in python)
            continue
        assert type(found) is MalformedBundle and found.reason == python, wrong
        assert found.reason.startswith("a bundle")
    assert fine == 1


def request_of(state: dict[str, Any]) -> PushPullRequest:
    """The request a server receives for ``state`` on the wire (as unpickling makes it)."""
    request = PushPullRequest.__new__(PushPullRequest)
    request.__setstate__(state)
    return request


def test_a_request_with_a_spoiled_bundle_is_refused_and_changes_nothing(
    make_server: MakeServer,
) -> None:
    endpoint = make_server(0, servers=1, trainers=1)  # all the dense parameters: two or more
    before = endpoint.shard.store.state_hash()
    dense = {name: torch.ones_like(slot.value) for name, slot in endpoint.shard.store.dense.items()}
    ids = own_ids(endpoint, 0, 1)
    request = PushPullRequest(
        trainer=0,
        call=0,
        dense_grads=dense,
        row_grads={"user.weight": RowBlock(ids, torch.ones(2, 4))},
        pull_rows={"user.weight": ids, "items.weight": ids},
    )
    state = request.__getstate__()
    wires = {"dense_grads": state["dense_grads"], "pull_rows": state["pull_rows"]}
    assert all(type(b) is Bundle for b in wires.values())  # else the test is vacuous
    values = Bundle(("user.weight", "items.weight"), ((1, 4), (1, 4)), torch.ones(2, 4))
    refused = 0
    for field, bundle in [*wires.items(), ("row_grads", values)]:
        for wrong in spoiled(bundle):
            sent = RowBlocksBundle({"user.weight": ids}, wrong) if field == "row_grads" else wrong
            received = request_of({**state, field: sent})
            with pytest.raises(ParamServerError, match=f"malformed request: {field}: a bundle"):
                endpoint.coordinator.push_pull(received).wait()
            refused += 1
    mismatched = RowBlocksBundle({"user.weight": ids}, {"items.weight": torch.ones(2, 4)})
    with pytest.raises(ParamServerError, match="name different tables"):
        endpoint.coordinator.push_pull(request_of({**state, "row_grads": mismatched})).wait()
    assert refused == 3 * len(spoiled(values))
    assert endpoint.shard.store.state_hash() == before and endpoint.shard.stats.pushes == 0
    endpoint.coordinator.push_pull(request_of(state)).wait()  # the unspoiled one is applied
    assert endpoint.shard.store.state_hash() != before


def test_a_spoiled_answer_is_a_typed_error_for_the_trainer(make_server: MakeServer) -> None:
    endpoint = make_server(0, servers=1, trainers=1)

    class SpoilingTransport(LocalTransport):
        def call(self, server: int, op: str, *args: Any, timeout_s: float | None = None) -> Any:
            def spoil(reply: PushPullReply) -> PushPullReply:
                state = reply.__getstate__()
                assert type(state["rows"]) is Bundle
                received = PushPullReply.__new__(PushPullReply)
                received.__setstate__({**state, "rows": spoiled(state["rows"])[-2]})
                return received

            return super().call(server, op, *args).then(lambda done: spoil(done.value()))

    client = PSClient(SpoilingTransport([endpoint]), endpoint.shard.plan, trainer=0)
    ids = own_ids(endpoint, 0, 1)
    call = client.push_pull({}, {}, {"user.weight": ids, "items.weight": ids})
    with pytest.raises(ParamServerError, match="server 0 sent a malformed answer: rows: a bundle"):
        call.wait()


def test_views_that_lie_end_to_end_travel_as_what_they_split_not_a_copy(loop_mode: str) -> None:
    """Rows a server read in one piece, or a bundle's own views: no second copy. Views that
    leave a gap, come out of order or are not views travel as a copy."""
    rows = torch.randn(10, 4)
    a, b, c = rows.split([3, 0, 7])
    joined = joined_already([a, b, c])
    assert joined is not None and joined.data_ptr() == rows.data_ptr()
    assert torch.equal(joined, rows)
    sent = bundled({"a": a, "b": b, "c": c})
    assert sent.flat.data_ptr() == rows.data_ptr()
    assert_same(
        through_the_wire(PushPullReply(rows={"a": a, "b": b, "c": c})).rows,
        {"a": a, "b": b, "c": c},
    )
    for parts in ([a, c[:5]], [c, a], [a.clone(), c], [rows[:, :2], rows[:, 2:]]):
        assert joined_already(parts) is None
        copied = bundled({str(i): part for i, part in enumerate(parts)})
        assert copied.flat.data_ptr() != rows.data_ptr()
        assert_same(unbundled(copied), {str(i): part for i, part in enumerate(parts)})
    # Two storages end to end in memory: views across them are not one storage's.
    memory = np.zeros(8, np.float32)
    left, right = torch.from_numpy(memory[:4]), torch.from_numpy(memory[4:])
    assert left.untyped_storage().data_ptr() + left.untyped_storage().nbytes() == right.data_ptr()
    assert joined_already([left, right]) is None
    # Views of other widths join flat; one that starts past its storage's start, or of
    # another dtype, does not join.
    whole = torch.arange(6.0)
    joined = joined_already([whole[:2].view(1, 2), whole[2:]])
    assert joined is not None and joined.shape == (6,) and joined.data_ptr() == whole.data_ptr()
    joined = joined_already(list(rows.view(-1).split([16, 24])))
    assert joined is not None and joined.shape == (40,)
    assert joined_already([rows[1:]]) is None
    assert joined_already([rows]).shape == (10, 4)  # type: ignore[union-attr]
    assert joined_already([a, c.view(torch.int32)]) is None


def test_a_nan_in_a_bundle_that_arrived_whole_is_refused(make_server: MakeServer) -> None:
    """The server sums a bundle of gradients as it arrived: a NaN in any of its views is found
    and named, and changes nothing."""
    endpoint = make_server(0, servers=1, trainers=1)
    before = endpoint.shard.store.state_hash()
    ids = own_ids(endpoint, 0, 1)
    grads = {"user.weight": torch.ones(2, 4), "items.weight": torch.ones(2, 4)}
    grads["items.weight"][1, 2] = float("nan")
    request = PushPullRequest(
        trainer=0, call=0, row_grads={name: RowBlock(ids, g) for name, g in grads.items()}
    )
    received = through_the_wire(request)
    assert joined_already([block.values for block in received.row_grads.values()]) is not None
    with pytest.raises(ParamServerError, match="items.weight.*NaN or Inf"):
        endpoint.coordinator.push_pull(received).wait()
    assert endpoint.shard.store.state_hash() == before
