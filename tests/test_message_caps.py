"""``--max-message-mb`` bounds what a call makes a server hold: its request decoded and the rows
its answer reads, for every operation; codecs a path never uses are refused before decoding.

The memory test runs a server in a process of its own (tests/_hostile_server.py) and reads its
peak resident size around each hostile call.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from paramserver.checkpoint import Part
from paramserver.errors import InvalidPushError, ParamServerError
from paramserver.wire.compression import Encoded, encode
from paramserver.wire.messages import BagBlock, PooledGrad, PushPullRequest, RowBlock
from tests.helpers import MakeServer, own_ids

ROOT = Path(__file__).resolve().parent.parent
# What a refused hostile call may add to the server's peak memory. Each claims 2 GB (about
# twice the default cap); before the caps the server allocated all of it.
PEAK_GROWTH_BOUND_MIB = 50


@pytest.fixture(scope="module")
def hostile_results() -> dict[str, dict[str, Any]]:
    run = subprocess.run(
        [sys.executable, "-m", "tests._hostile_server"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {line["case"]: line for line in lines}


HOSTILE_CASES = {
    "top-k row gradient of 8M ids": "fixed.weight",
    "pull of 8M ids": "hashed.weight",
    "pull of 8M packed ids": "hashed.weight",
    "push_pull pooling one row 8M times": "fixed.weight",
}


@pytest.mark.system
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", sorted(HOSTILE_CASES))
def test_a_hostile_call_is_refused_within_a_memory_bound(
    case: str, hostile_results: dict[str, dict[str, Any]]
) -> None:
    result = hostile_results[case]
    assert result["error"] is not None, f"{case}: answered, growing {result['peak_growth_mib']} MiB"
    assert result["error"]["type"] == "InvalidPushError", result["error"]
    message = result["error"]["message"]
    assert "server 0" in message and repr(HOSTILE_CASES[case]) in message, message
    assert "exceeds the cap" in message and "--max-message-mb" in message, message
    assert result["peak_growth_mib"] < PEAK_GROWTH_BOUND_MIB, result
    assert result["state_unchanged"], result


def test_top_k_is_refused_for_rows_and_pooled_vectors_but_not_dense_gradients(
    make_server: MakeServer,
) -> None:
    endpoint = make_server(servers=1, trainers=1)
    before = endpoint.shard.store.state_hash()
    rows = RowBlock(own_ids(endpoint, 0, 1), encode("topk", torch.ones(2, 4), topk_ratio=0.5))
    with pytest.raises(InvalidPushError, match="codec topk is not used here") as caught:
        endpoint.handle(
            "push_pull", (PushPullRequest(0, 0, row_grads={"user.weight": rows}),)
        ).wait()
    assert "'user.weight'" in str(caught.value) and "server 0" in str(caught.value)
    assert endpoint.shard.store.state_hash() == before

    # Pooled gradients: pull bags first, then send their gradient top-k encoded.
    bags = BagBlock(own_ids(endpoint, 0, 1), torch.tensor([0, 1]), 2)
    endpoint.handle("push_pull", (PushPullRequest(0, 0, pool_rows={"items.weight": bags}),)).wait()
    before = endpoint.shard.store.state_hash()
    pooled = PooledGrad(0, encode("topk", torch.ones(2, 4), topk_ratio=0.5))
    request = PushPullRequest(0, 1, grads_call=0, pooled_grads={"items.weight": pooled})
    with pytest.raises(InvalidPushError, match="codec topk is not used here"):
        endpoint.handle("push_pull", (request,)).wait()
    assert endpoint.shard.store.state_hash() == before

    # Dense gradients may come top-k encoded (with error feedback on the trainer).
    name, slot = next(iter(endpoint.shard.store.dense.items()))
    dense = {name: encode("topk", torch.ones(slot.value.shape), topk_ratio=0.5)}
    endpoint.handle("push_pull", (PushPullRequest(0, 1, grads_call=0, dense_grads=dense),)).wait()
    assert endpoint.shard.store.state_hash() != before


def test_row_ids_are_checked_before_a_row_gradient_is_decoded(make_server: MakeServer) -> None:
    endpoint = make_server()
    before = endpoint.shard.store.state_hash()
    # Valid int8 for 2 rows, so only the ids (routed to the other server) are wrong.
    block = RowBlock(own_ids(endpoint, 0, 1) + 1, encode("int8", torch.ones(2, 4)))
    request = PushPullRequest(0, 0, row_grads={"user.weight": block})
    with pytest.raises(InvalidPushError, match="routed to the wrong server"):
        endpoint.handle("push_pull", (request,)).wait()
    assert type(block.values) is Encoded  # refused before it was decoded
    assert endpoint.shard.store.state_hash() == before


def test_the_cap_counts_encoded_tensors_decoded_and_the_rows_an_answer_reads(
    make_server: MakeServer,
) -> None:
    endpoint = make_server(servers=1, trainers=1, max_message_mb=1 / 4096)  # 256 bytes
    before = endpoint.shard.store.state_hash()
    # 12 rows of 4: 96 bytes of ids + 48 of int8 + 24 of scales on the wire, under the cap;
    # decoding adds 192.
    block = RowBlock(own_ids(endpoint, *range(12)), encode("int8", torch.ones(12, 4)))
    push = PushPullRequest(0, 0, row_grads={"user.weight": block})
    with pytest.raises(InvalidPushError, match=r"parameter 'user.weight'.*exceeds the cap"):
        endpoint.handle("push_pull", (push,)).wait()
    # 10 ids (80 bytes) whose rows are 160 bytes: each under the cap.
    ids = own_ids(endpoint, *range(10))
    pull = PushPullRequest(0, 0, pull_dense=False, pull_rows={"items.weight": ids})
    assert endpoint.handle("pull", (pull,)).wait().rows["items.weight"].shape == (10, 4)
    # 20 ids: 160 bytes, and an answer of 320 bytes of rows.
    many = PushPullRequest(
        0, 0, pull_dense=False, pull_rows={"items.weight": own_ids(endpoint, *range(20))}
    )
    for op in ("pull", "push_pull"):
        with pytest.raises(InvalidPushError, match=r"'items.weight'.*answer reading 320 bytes"):
            endpoint.handle(op, (many,)).wait()
    assert endpoint.shard.store.state_hash() == before
    assert endpoint.coordinator.last_call == {}  # the refused push_pull was not counted


def test_every_operation_s_arguments_are_capped(make_server: MakeServer) -> None:
    endpoint = make_server(max_message_mb=1 / 1024)  # 1 KiB
    big = Part("x" * 2000, {})  # type: ignore[arg-type]
    with pytest.raises(ParamServerError, match="add_trainer_part call holding .* exceeds the cap"):
        endpoint.handle("add_trainer_part", (1, 0, big)).wait()
    with pytest.raises(ParamServerError, match="dense_check call holding .* exceeds the cap"):
        endpoint.handle("dense_check", ({"w" * 600: "c" * 600},)).wait()
    assert endpoint.handle("dense_check", ({},)).wait() == {}


def test_message_nbytes_bounds_what_a_message_holds_and_survives_any_message() -> None:
    from paramserver.wire.sizing import message_nbytes

    ids = torch.arange(10)
    assert message_nbytes(RowBlock(ids, torch.ones(10, 4))) == 80 + 160
    int8 = encode("int8", torch.ones(10, 4))
    assert message_nbytes(int8) == 40 + 20 + 160  # payload, then what it decodes to
    assert message_nbytes(encode("none", torch.ones(10, 4))) == 160  # decodes to itself
    shared = torch.ones(100)
    assert message_nbytes([shared, shared, {"k": shared}]) == 400 + 1
    assert message_nbytes(torch.zeros(1).expand(1000)) == 4000  # views count all elements
    huge = Encoded("topk", (10**12,) * 1000, (torch.zeros(1, dtype=torch.int32), torch.ones(1)))
    assert message_nbytes(huge) >= 2**62
    assert message_nbytes(Encoded("int8", ("x", -1), ())) == 0
    cycle: list[Any] = []
    cycle.append(cycle)
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    assert message_nbytes([cycle, deep, object(), 3, None]) == 0


def test_message_nbytes_walks_subclasses_as_their_base_types() -> None:
    """What the walk does with an object is decided once per type: a subclass of a tensor, a
    dict, a tuple or a dataclass is measured like its base, and a class is not an instance."""
    from collections import OrderedDict, namedtuple

    from paramserver.wire.sizing import message_nbytes

    @dataclass
    class Sub(RowBlock):
        pass

    pair = namedtuple("pair", "a b")
    weights = torch.nn.Parameter(torch.ones(10))
    message = OrderedDict(w=weights, p=pair(torch.ones(5), "xy"), s=Sub(torch.arange(3), None))
    assert message_nbytes(message) == len("wps") + 40 + 20 + 2 + 24
    assert message_nbytes([RowBlock, Sub, torch.Tensor]) == 0  # classes hold nothing


def test_payload_size_counts_tensor_data_as_sent_and_uncompressed(loop_mode: str) -> None:
    """What a call's figures count (bytes sent, and what they would be uncompressed): every
    tensor's data, walked through whatever holds it, an encoded tensor by its payload and the
    float32 tensor it stands for, packed ids as packed. The loops walk as Python does."""
    from collections import OrderedDict, namedtuple
    from types import MappingProxyType

    from paramserver.wire.idcodec import PackedIds, compact_ids
    from paramserver.wire.sizing import PayloadSize, payload_nbytes, payload_size

    pair = namedtuple("pair", "a b")
    int8 = encode("int8", torch.ones(10, 4))  # 40 int8 values and 10 bfloat16 scales
    packed = compact_ids(torch.arange(0, 30, 3))  # 10 uint8 steps and the first id
    message = OrderedDict(
        rows=RowBlock(torch.arange(3), torch.nn.Parameter(torch.ones(3, 2))),
        view=torch.zeros(100)[10:20],  # a view counts its own elements
        nested=[pair(int8, "text"), (packed, None, 7, 2.5, b"raw")],
        mapping=MappingProxyType({"half": torch.ones(4, dtype=torch.float16)}),
        classes=[RowBlock, torch.Tensor],  # a class is not an instance
    )
    assert payload_size(message) == PayloadSize(
        24 + 24 + 40 + 60 + 18 + 8, 24 + 24 + 40 + 160 + 18 + 8
    )
    assert payload_nbytes(message) == 174
    assert payload_size({}) == PayloadSize(0, 0)
    # A claim of absurd size counts 2^62 bytes; two of them pass int64, counted all the same.
    huge = Encoded("topk", (10**12,) * 3, (torch.zeros(1, dtype=torch.int32), torch.ones(1)))
    assert payload_size([huge, torch.ones(1)]) == PayloadSize(12, 2**62 + 4)
    assert payload_size([huge, huge, torch.ones(1)]) == PayloadSize(20, 2**63 + 4)
    # A peer's malformed encoded tensor or packed ids is measured, not a failure.
    forged = [Encoded("int8", 5, None), Encoded("int8", ("x",), ()), PackedIds(3, "steps")]  # type: ignore[arg-type]
    assert payload_size(forged) == PayloadSize(8, 8)
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(RecursionError):
        payload_size(deep)
