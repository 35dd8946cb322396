"""A call as one frame of bytes: a small fixed header, the message's structure, then its tensors'
data end to end.

TensorPipe ships each tensor of an RPC message as a buffer of its own, with a cost per buffer far
above a copy: a bare round trip costs its caller about 260 us of CPU, one holding two small
tensors about 520 us, one holding the same data as bytes about 300 us (loopback, this project's
machines; ``benchmarks/bench_rpc_floor.py``). So the RPC transport sends every call and answer as
one ``bytes`` frame (:func:`encode`, :func:`decode`), whatever tensors it holds.

Layout, little-endian::

    magic "PSFR" | version u16 | reserved u16 | tensors u32 | structure bytes u64
    structure (a pickle in which each plain tensor is a reference to the data part)
    data: each tensor's bytes in the order referenced, each from an offset (counted from
          the data's start) aligned to 8

Only a tensor's own elements travel (a view's, not its whole storage). A frame of another version
is refused with :class:`FrameError` naming both versions, before anything of it is read; so is a
frame whose references do not match its data exactly (a peer's frame is checked as it is read).
Decoded tensors are writable views of one buffer the receiver owns.
"""

from __future__ import annotations

import io
import pickle
import struct
import threading
from typing import Any

import torch
from torch import Tensor

from paramserver.errors import ParamServerError

MAGIC = b"PSFR"
VERSION = 1
_HEADER = struct.Struct("<4sHHIQ")
_ALIGN = 8

# The dtypes a frame carries as data (any other tensor travels pickled in the structure).
_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32, torch.float64, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class FrameError(ParamServerError, ValueError):
    """A frame that cannot be read: another version, or damaged (what is wrong is said)."""


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _travels_as_data(value: Tensor) -> bool:
    return (
        value.dtype in _DTYPE_NAMES
        and value.device.type == "cpu"
        and value.layout is torch.strided
        and not value.requires_grad
        and not value.is_conj()
        and not value.is_neg()
    )


class _Pickler(pickle.Pickler):
    """Pickles a message's structure; its plain tensors become references to the data part."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[Tensor] = []

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is not Tensor or not _travels_as_data(obj):
            return NotImplemented
        self.tensors.append(obj)
        return _tensor_of_frame, (_DTYPE_NAMES[obj.dtype], tuple(obj.shape))


def encode(message: Any) -> bytes:
    """``message`` as one frame (its tensors are copied: the caller may change them after)."""
    structure = io.BytesIO()
    pickler = _Pickler(structure)
    pickler.dump(message)
    tensors = pickler.tensors
    head = _HEADER.pack(MAGIC, VERSION, 0, len(tensors), structure.tell())
    parts: list[Any] = [head, structure.getbuffer()]
    at = 0  # in the data part
    for tensor in tensors:
        pad = _aligned(at) - at
        if pad:
            parts.append(bytes(pad))
        data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        parts.append(data)
        at += pad + data.nbytes
    return b"".join(parts)


class _Reading(threading.local):
    """The frame being decoded on this thread: where its next tensor's data starts."""

    data: Tensor | None = None
    at: int = 0
    count: int = 0


_READING = _Reading()


def _tensor_of_frame(dtype_name: str, shape: tuple[int, ...]) -> Tensor:
    """A tensor's place in the frame being decoded (see :func:`decode`): the next data."""
    data = _READING.data
    if data is None:
        raise FrameError("a frame's tensor outside a frame")
    dtype = _DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if dtype is None:
        raise FrameError(f"a frame's tensor of an unknown dtype {dtype_name!r}")
    if type(shape) is not tuple or not all(type(d) is int and d >= 0 for d in shape):
        raise FrameError("a frame's tensor shape is not a tuple of sizes")
    start = _aligned(_READING.at)
    numel = 1
    for size in shape:
        numel *= size
        if numel > data.numel():  # stop early: an absurd claim is slow to multiply out
            break
    end = start + numel * dtype.itemsize
    if end > data.numel():
        raise FrameError("a frame's tensors claim more data than it holds")
    _READING.at, _READING.count = end, _READING.count + 1
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return data[start:end].view(dtype).view(shape)


def decode(frame: bytes | bytearray | memoryview) -> Any:
    """The message of :func:`encode`'s ``frame``; :class:`FrameError` where it is of another
    version or damaged. Its tensors are writable views of one copy of the frame's data."""
    view = memoryview(frame)
    if view.nbytes < _HEADER.size:
        raise FrameError(f"a frame of {view.nbytes} bytes is shorter than its header")
    magic, version, _, num_tensors, structure_bytes = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise FrameError(f"not a paramserver frame (it starts {bytes(magic)!r})")
    if version != VERSION:
        raise FrameError(
            f"a frame of version {version} from a peer of another paramserver release: "
            f"this process reads version {VERSION} (run one release in a job)"
        )
    structure_end = _HEADER.size + structure_bytes
    if structure_end > view.nbytes:
        raise FrameError("a frame's structure runs past its end")
    data = (
        torch.frombuffer(bytearray(view[structure_end:]), dtype=torch.uint8)
        if structure_end < view.nbytes
        else torch.empty(0, dtype=torch.uint8)
    )
    reading = _READING
    if reading.data is not None:
        raise FrameError("a frame decoded inside another")
    reading.data, reading.at, reading.count = data, 0, 0
    try:
        message = pickle.loads(view[_HEADER.size : structure_end])
        at, count = reading.at, reading.count
    except FrameError:
        raise
    except Exception as error:
        raise FrameError(f"a frame's structure cannot be read: {error}") from error
    finally:
        reading.data = None
    if count != num_tensors:
        raise FrameError(f"a frame says {num_tensors} tensors but its structure holds {count}")
    if at != data.numel():
        raise FrameError("a frame holds more data than its tensors")
    return message
