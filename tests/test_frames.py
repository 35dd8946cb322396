"""A call as a frame (paramserver.wire.frames): messages arrive equal, small tensors inside the
frame and large ones beside it, only a tensor's own elements travel, decoded tensors are the
receiver's to write, and a frame of another version or a damaged one is refused with a typed
error, by the decoder, by a server's RPC entry and by a trainer's transport."""

from __future__ import annotations

import gc
import pickle
import struct
from typing import Any

import pytest
import torch
import torch.distributed.rpc as torch_rpc
from torch.futures import Future

from paramserver import native
from paramserver.errors import TrainerDepartedError
from paramserver.futures import failed
from paramserver.transport import rpc as rpc_transport
from paramserver.wire import frames
from paramserver.wire.frames import FrameError
from paramserver.wire.messages import PushPullReply, PushPullRequest, RowBlock


def roundtrip(message: Any) -> Any:
    return frames.decode(*frames.encode(message))


def every_dtype_and_shape() -> dict[str, Any]:
    return {
        "f32": torch.randn(3, 4),
        "f64": torch.randn(5, dtype=torch.float64),
        "f16": torch.randn(3, dtype=torch.float16),
        "bf16": torch.randn(2, 2, dtype=torch.bfloat16),
        "i64": torch.arange(7),
        "i32": torch.arange(5, dtype=torch.int32),
        "i16": torch.arange(3, dtype=torch.int16),
        "u8": torch.arange(9, dtype=torch.uint8),
        "i8": torch.tensor([-3, 4], dtype=torch.int8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 16),
        "strided": torch.randn(4, 6)[:, 1::2],
        "offset": torch.arange(20)[5:9],  # a view from within its storage
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),  # strides of 0
        "large": torch.randn(300, 64),
        "large_view": torch.randn(600, 64)[100:400],
        "other": [1, "two", None, (3.0,)],
        "complex": torch.randn(2, dtype=torch.complex64),  # no dtype a frame carries: pickled
    }


def test_a_message_arrives_equal_with_every_dtype_and_shape(loop_mode: str) -> None:
    message = every_dtype_and_shape()
    arrived = roundtrip(message)
    assert arrived.keys() == message.keys()
    for name, value in message.items():
        if isinstance(value, torch.Tensor):
            assert arrived[name].dtype == value.dtype and torch.equal(arrived[name], value), name
        else:
            assert arrived[name] == value


def test_the_compiled_loops_encode_the_frame_pythons_encoding_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loops' reducer and copies (where they take tensors) make the frame the frame's own
    Python makes: the same data, the same large tensors beside it, the same message read back
    (the structures may differ in which equal strings the pickle writes once)."""
    if not native.takes_tensors():
        pytest.skip("the compiled loops do not take tensors here")
    message = every_dtype_and_shape()
    compiled_frame, compiled_large = frames.encode(message)
    compiled = frames.decode(compiled_frame, compiled_large)
    monkeypatch.setattr(native, "loops", None)
    frame, large = frames.encode(message)
    data = frames._HEADER.size + frames._HEADER.unpack_from(frame)[-1]
    compiled_data = frames._HEADER.size + frames._HEADER.unpack_from(compiled_frame)[-1]
    assert compiled_frame[frames._aligned(compiled_data) :] == frame[frames._aligned(data) :]
    assert len(compiled_large) == len(large) == 2
    assert all(torch.equal(a, b) for a, b in zip(compiled_large, large, strict=True))
    assert compiled_large[0] is message["large"]  # a whole tensor travels as it is
    for name, value in frames.decode(frame, large).items():
        if isinstance(value, torch.Tensor):
            assert compiled[name].dtype == value.dtype and torch.equal(compiled[name], value)
        else:
            assert compiled[name] == value


def test_a_request_and_reply_arrive_equal() -> None:
    bias, grads, rows = torch.randn(4), torch.randn(2, 8), torch.randn(3, 8)
    request = PushPullRequest(
        2, 9, dense_grads={"w": torch.randn(4, 4), "b": bias},
        row_grads={"t": RowBlock(torch.tensor([1, 5]), grads)},
        pull_rows={"t": torch.tensor([0, 3, 7])},
    )  # fmt: skip
    arrived = roundtrip(request)
    assert (arrived.trainer, arrived.call) == (2, 9) and arrived.malformed() is None
    assert torch.equal(arrived.dense_grads["b"], bias)
    assert torch.equal(arrived.row_grads["t"].values, grads)
    back = roundtrip(PushPullReply(rows={"t": rows}, checkpoint_at=4))
    assert torch.equal(back.rows["t"], rows) and back.checkpoint_at == 4


def test_a_frame_of_empty_tensors_alone_holds_no_data(loop_mode: str) -> None:
    message = [torch.zeros(0, dtype=torch.int64), torch.zeros(3, 0), torch.zeros(0, 1 << 40)]
    arrived = roundtrip(message)
    assert [t.shape for t in arrived] == [(0,), (3, 0), (0, 1 << 40)]
    assert all(a.dtype == m.dtype for a, m in zip(arrived, message, strict=True))


def test_small_tensors_travel_in_the_frame_and_large_ones_beside_it(loop_mode: str) -> None:
    small, large = torch.zeros(100), torch.zeros(frames.LARGE_BYTES // 4)
    frame, beside = frames.encode({"small": small, "large": large})
    assert len(frame) < 1_000 and len(beside) == 1 and beside[0] is large


def test_only_a_views_own_elements_travel(loop_mode: str) -> None:
    big = torch.zeros(1_000_000)
    frame, beside = frames.encode([big[:10], big[:100_000]])
    assert len(frame) < 1_000
    assert beside[0].untyped_storage().nbytes() == 400_000


def test_decoded_tensors_are_writable_views_of_the_frame_and_the_senders_are_untouched(
    loop_mode: str,
) -> None:
    sent = [torch.zeros(3), torch.ones(2, dtype=torch.int64)]
    frame, large = frames.encode(sent)
    first, second = frames.decode(frame, large)
    first += 1
    second[0] = 7
    assert torch.equal(frames.decode(frame, large)[0], torch.ones(3))  # read in place
    assert torch.equal(sent[0], torch.zeros(3)) and torch.equal(sent[1], torch.ones(2))
    copied = frames.decode(bytes(frame), large)[0]  # bytes are read from a copy
    copied += 1
    assert torch.equal(frames.decode(frame, large)[0], torch.ones(3))
    kept = frames.decode(frames.encode([torch.arange(5.0)])[0])[0]  # its frame dropped
    gc.collect()
    assert torch.equal(kept, torch.arange(5.0))


def test_tensors_that_are_not_plain_data_travel_pickled(loop_mode: str) -> None:
    weight = torch.nn.Parameter(torch.randn(3))
    arrived = roundtrip({"weight": weight})["weight"]
    assert isinstance(arrived, torch.nn.Parameter) and torch.equal(arrived, weight)


def encoded(message: Any) -> bytes:
    frame, large = frames.encode(message)
    assert not large
    return bytes(frame)


def frame_of_version(version: int) -> bytes:
    frame = bytearray(encoded(("push_pull", ())))
    struct.pack_into("<H", frame, 4, version)
    return bytes(frame)


def test_a_frame_of_another_version_is_refused_naming_both() -> None:
    newer, older = frames.VERSION + 1, frames.VERSION - 1
    with pytest.raises(FrameError, match=rf"version {newer} .* reads version {frames.VERSION}"):
        frames.decode(frame_of_version(newer))
    with pytest.raises(FrameError, match=rf"version {older} .* reads version {frames.VERSION}"):
        frames.decode(frame_of_version(older))  # a peer of before row state blocks


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (b"PSF", "shorter than its header"),
        (b"JUNK" + bytes(32), "not a paramserver frame"),
        (encoded([torch.zeros(4)])[:-4], "claim more data than it holds"),
        (encoded([torch.zeros(4)]) + bytes(8), "more data than its tensors"),
        (encoded("x")[:-2], "structure runs past its end|cannot be read"),
    ],
)
def test_a_damaged_frame_is_refused_saying_why(frame: bytes, reason: str) -> None:
    with pytest.raises(FrameError, match=reason):
        frames.decode(frame)


def test_a_frame_whose_count_of_tensors_lies_is_refused() -> None:
    frame = bytearray(encoded([torch.zeros(2), torch.zeros(2)]))
    struct.pack_into("<I", frame, 8, 1)
    with pytest.raises(FrameError, match="says 1 tensors but its structure holds 2"):
        frames.decode(bytes(frame))


def test_large_tensors_that_do_not_match_the_frame_are_refused() -> None:
    frame, _ = frames.encode([torch.zeros(frames.LARGE_BYTES)])
    with pytest.raises(FrameError, match="says 1 large tensors but 0 came"):
        frames.decode(frame)
    with pytest.raises(FrameError, match="must be a list of plain CPU tensors"):
        frames.decode(frame, ["not a tensor"])  # type: ignore[list-item]
    with pytest.raises(FrameError, match="refers to large tensor 0 of 0"):
        forged = bytearray(frame)
        struct.pack_into("<I", forged, 12, 0)
        frames.decode(bytes(forged))


class _Forged:
    """Pickles as a reference to frame data of ``shape`` (what a hostile peer could send)."""

    def __init__(self, dtype: Any, shape: Any):
        self.dtype, self.shape = dtype, shape

    def __reduce__(self) -> Any:
        return frames._small_tensor, (self.dtype, self.shape)


@pytest.mark.parametrize(
    ("forged", "reason"),
    [
        (_Forged("float32", (1 << 40, 1 << 40)), "claim more data than it holds"),
        (_Forged("complex64", (1,)), "unknown dtype"),
        (_Forged("float32", (1 << 62, 1 << 62, 1 << 62)), "claim more data than it holds"),
        (_Forged("int64", (3,)), "claim more data than it holds"),  # 24 bytes of 16
        (_Forged("complex64", (1,)), "unknown dtype"),
        (_Forged(7, (1,)), "unknown dtype"),
        (_Forged("float32", (-1,)), "not a tuple of sizes"),
        (_Forged("float32", [1]), "not a tuple of sizes"),
        (_Forged("float32", (True,)), "not a tuple of sizes"),
        (_Forged("float32", ("1",)), "not a tuple of sizes"),
        (_Forged("float32", (1 << 70,)), "claim more data than it holds"),
        (_Forged("float32", (-(1 << 70),)), "not a tuple of sizes"),
    ],
)
def test_a_forged_tensor_reference_is_refused(forged: _Forged, reason: str, loop_mode: str) -> None:
    structure = pickle.dumps([forged])
    frame = struct.pack("<4sHHIIQ", frames.MAGIC, frames.VERSION, 0, 1, 0, len(structure))
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
    values = (torch.arange(5), torch.randn(frames.LARGE_BYTES))
    answer: Any = frames.decode(*rpc_transport._serve(*frames.encode(("pull", values))).wait())
    assert answer[0] == "pull" and all(map(torch.equal, answer[1], values))
    with pytest.raises(FrameError, match="version 7"):
        rpc_transport._serve(frame_of_version(7), []).wait()


def test_a_servers_error_leaves_its_rpc_entry_as_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not wrapped as the RuntimeError of a failed callback: a trainer told it was declared
    departed must not take it for a lost server."""

    class Refusing:
        def handle(self, op: object, args: object) -> Future:
            return failed(TrainerDepartedError("server 0: trainer 2 was declared departed"))

    monkeypatch.setattr(rpc_transport, "_ENDPOINT", Refusing())
    with pytest.raises(TrainerDepartedError, match="^server 0: trainer 2 was declared"):
        rpc_transport._serve(*frames.encode(("push_pull", ()))).wait()


def test_a_damaged_answer_is_a_typed_error_for_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    answered: Future = Future()
    answered.set_result((b"JUNK" + bytes(32), []))
    monkeypatch.setattr(torch_rpc, "rpc_async", lambda *args, **kwargs: answered)
    transport = rpc_transport.RpcTransport(num_servers=1, timeout_s=60.0)
    with pytest.raises(FrameError, match="not a paramserver frame"):
        transport.call(0, "stats").wait()  # a control call: over RPC
