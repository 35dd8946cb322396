"""A call as one frame of bytes (paramserver.wire.frames): messages arrive equal, only a tensor's
own elements travel, decoded tensors are the receiver's to write, and a frame of another version
or a damaged one is refused with a typed error, by the decoder and by a server's RPC entry."""

from __future__ import annotations

import pickle
import struct
from typing import Any

import pytest
import torch
from torch.futures import Future

from paramserver.transport import rpc as rpc_transport
from paramserver.wire import frames
from paramserver.wire.frames import FrameError
from paramserver.wire.messages import PushPullReply, PushPullRequest, RowBlock


def test_a_message_arrives_equal_with_every_dtype_and_shape() -> None:
    message = {
        "f32": torch.randn(3, 4),
        "f64": torch.randn(5, dtype=torch.float64),
        "bf16": torch.randn(2, 2, dtype=torch.bfloat16),
        "i64": torch.arange(7),
        "i8": torch.tensor([-3, 4], dtype=torch.int8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 16),
        "strided": torch.randn(4, 6)[:, 1::2],
        "other": [1, "two", None, (3.0,)],
    }
    arrived = frames.decode(frames.encode(message))
    assert arrived.keys() == message.keys()
    for name, value in message.items():
        if isinstance(value, torch.Tensor):
            assert arrived[name].dtype == value.dtype and torch.equal(arrived[name], value), name
        else:
            assert arrived[name] == value


def test_a_request_and_reply_arrive_equal() -> None:
    bias, grads, rows = torch.randn(4), torch.randn(2, 8), torch.randn(3, 8)
    request = PushPullRequest(
        2, 9, dense_grads={"w": torch.randn(4, 4), "b": bias},
        row_grads={"t": RowBlock(torch.tensor([1, 5]), grads)},
        pull_rows={"t": torch.tensor([0, 3, 7])},
    )  # fmt: skip
    arrived = frames.decode(frames.encode(request))
    assert (arrived.trainer, arrived.call) == (2, 9) and arrived.malformed() is None
    assert torch.equal(arrived.dense_grads["b"], bias)
    assert torch.equal(arrived.row_grads["t"].values, grads)
    back = frames.decode(frames.encode(PushPullReply(rows={"t": rows}, checkpoint_at=4)))
    assert torch.equal(back.rows["t"], rows) and back.checkpoint_at == 4


def test_only_a_views_own_elements_travel() -> None:
    big = torch.zeros(1_000_000)
    assert len(frames.encode(big[:10])) < 1_000


def test_decoded_tensors_are_writable_and_the_receivers_own() -> None:
    frame = frames.encode([torch.zeros(3), torch.ones(2, dtype=torch.int64)])
    first, second = frames.decode(frame)
    first += 1
    second[0] = 7
    again = frames.decode(frame)  # the frame itself is untouched
    assert torch.equal(again[0], torch.zeros(3)) and torch.equal(first, torch.ones(3))


def test_tensors_that_are_not_plain_data_travel_pickled() -> None:
    weight = torch.nn.Parameter(torch.randn(3))
    arrived = frames.decode(frames.encode({"weight": weight}))["weight"]
    assert isinstance(arrived, torch.nn.Parameter) and torch.equal(arrived, weight)


def frame_of_version(version: int) -> bytes:
    frame = bytearray(frames.encode(("push_pull", ())))
    struct.pack_into("<H", frame, 4, version)
    return bytes(frame)


def test_a_frame_of_another_version_is_refused_naming_both() -> None:
    with pytest.raises(FrameError, match=r"version 2 .* reads version 1"):
        frames.decode(frame_of_version(2))


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (b"PSF", "shorter than its header"),
        (b"JUNK" + bytes(16), "not a paramserver frame"),
        (frames.encode([torch.zeros(4)])[:-4], "claim more data than it holds"),
        (frames.encode([torch.zeros(4)]) + bytes(8), "more data than its tensors"),
        (frames.encode("x")[:-2], "structure runs past its end|cannot be read"),
    ],
)
def test_a_damaged_frame_is_refused_saying_why(frame: bytes, reason: str) -> None:
    with pytest.raises(FrameError, match=reason):
        frames.decode(frame)


def test_a_frame_whose_count_of_tensors_lies_is_refused() -> None:
    frame = bytearray(frames.encode([torch.zeros(2), torch.zeros(2)]))
    struct.pack_into("<I", frame, 8, 1)
    with pytest.raises(FrameError, match="says 1 tensors but its structure holds 2"):
        frames.decode(bytes(frame))


class _Forged:
    """Pickles as a reference to frame data of ``shape`` (what a hostile peer could send)."""

    def __init__(self, dtype: str, shape: Any):
        self.dtype, self.shape = dtype, shape

    def __reduce__(self) -> Any:
        return frames._tensor_of_frame, (self.dtype, self.shape)


@pytest.mark.parametrize(
    ("forged", "reason"),
    [
        (_Forged("float32", (1 << 40, 1 << 40)), "claim more data than it holds"),
        (_Forged("complex64", (1,)), "unknown dtype"),
        (_Forged("float32", (-1,)), "not a tuple of sizes"),
    ],
)
def test_a_forged_tensor_reference_is_refused(forged: _Forged, reason: str) -> None:
    structure = pickle.dumps([forged])
    frame = struct.pack("<4sHHIQ", frames.MAGIC, frames.VERSION, 0, 1, len(structure))
    with pytest.raises(FrameError, match=reason):
        frames.decode(frame + structure + bytes(16))


class _Echo:
    """An endpoint that answers every call with its arguments."""

    def handle(self, op: object, args: object) -> Future:
        answer: Future = Future()
        answer.set_result((op, args))
        return answer


def test_a_servers_rpc_entry_answers_a_frame_and_refuses_another_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rpc_transport, "_ENDPOINT", _Echo())
    value = torch.arange(5)
    answer: Any = frames.decode(rpc_transport._serve(frames.encode(("pull", (value,)))).wait())
    assert answer[0] == "pull" and torch.equal(answer[1][0], value)
    with pytest.raises(FrameError, match="version 7"):
        rpc_transport._serve(frame_of_version(7)).wait()
