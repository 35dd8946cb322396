"""A call as a frame: a small fixed header with a version, the message's structure, its small
tensors' data end to end; its large tensors beside it.

What a round trip over TensorPipe costs its caller (``benchmarks/bench_rpc_floor.py``, loopback,
this project's machines): about 230 us of CPU carrying nothing, about 80 us more for each tensor
it carries, and about 1 us more per KB of ``bytes`` (which it copies into its pickle and out
again). So small tensors are cheapest copied into one frame of bytes (a ``bytearray``, which the
receiver then owns and reads in place) and large ones shipped as TensorPipe's buffers, as they
are. :func:`encode` makes ``(frame, large)``: ``frame`` the bytearray,
``large`` the tensors of :data:`LARGE_BYTES` or more (each its own storage exactly, so no more
than its elements travels); :func:`decode` takes both back.

Layout of ``frame``, little-endian::

    magic "PSFR" | version u16 | reserved u16 | small tensors u32 | large tensors u32
    | structure bytes u64
    structure: a pickle in which each plain tensor is a reference (to the data part, or by
               index to ``large``)
    data, from an offset aligned to 8: the small tensors' bytes in the order referenced, each
               from an offset aligned to 8

A frame of another version is refused with :class:`FrameError` naming both versions, before
anything of it is read; so is one whose references do not match its data and its large tensors
exactly (a peer's frame is checked as it is read). Decoded small tensors are writable views of
the frame's data (of a copy where the frame is ``bytes``), which the receiver owns, as it owns
the large ones.
"""

from __future__ import annotations

import ctypes
import io
import pickle
import struct
import threading
from typing import Any

import numpy as np
import torch
from torch import Tensor

from paramserver import native_frames
from paramserver.errors import ParamServerError

MAGIC = b"PSFR"
VERSION = 3  # 2: an answer's row state in RowStateBlocks; 3: a trainer's ids in PackedTables
_HEADER = struct.Struct("<4sHHIIQ")
_ALIGN = 8
LARGE_BYTES = 16 * 1024  # a tensor this large or larger travels beside the frame

# The dtypes a frame carries as data (any other tensor travels pickled in the structure), in
# an order a peer may number them by (a data socket's large tensors: transport/sockets.py).
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip
_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in DTYPES}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
# Each one's numpy type, as a frame's data is read (bfloat16's bits as int16: numpy has none).
_NUMPY_DTYPES = {
    dtype: torch.empty(0, dtype=torch.int16 if dtype is torch.bfloat16 else dtype).numpy().dtype
    for dtype in _DTYPES.values()
}


class FrameError(ParamServerError, ValueError):
    """A frame that cannot be read: another version, or damaged (what is wrong is said)."""


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _plain(value: Tensor) -> bool:
    return (
        value.dtype in _DTYPE_NAMES
        and value.is_cpu
        and value.layout is torch.strided
        and not value.requires_grad
        and not value.is_conj()
        and not value.is_neg()
    )


class _Pickler(pickle.Pickler):
    """Pickles a message's structure; its plain tensors become references."""

    def __init__(self, file: io.BytesIO):
        self.small: list[Tensor] = []
        self.large: list[Tensor] = []
        # The loops' reducer where they take tensors (a Python call and a dozen of torch's
        # per tensor less); the pickler reads it as it is made, so it is set before.
        reducer = native_frames.frame_reducer(
            self.small, self.large, _small_tensor, _large_tensor, LARGE_BYTES
        )
        if reducer is not None:
            self.reducer_override = reducer  # type: ignore[method-assign,assignment]
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is not Tensor or not _plain(obj):
            return NotImplemented
        nbytes = obj.nbytes
        if nbytes >= LARGE_BYTES:
            whole = obj.is_contiguous() and obj.untyped_storage().nbytes() == nbytes
            self.large.append(obj if whole else obj.contiguous().clone())
            return _large_tensor, (len(self.large) - 1,)
        self.small.append(obj)
        return _small_tensor, (_DTYPE_NAMES[obj.dtype], tuple(obj.shape))


def encode(message: Any) -> tuple[bytearray, list[Tensor]]:
    """``message`` as a frame and its large tensors (see the module docstring). The small
    tensors are copied; the large ones are the message's own (or a copy of a view's
    elements): the caller must not change them until the call is sent."""
    structure = io.BytesIO()
    pickler = _Pickler(structure)
    pickler.dump(message)
    small, large = pickler.small, pickler.large
    head = _HEADER.pack(MAGIC, VERSION, 0, len(small), len(large), structure.tell())
    data_start = _aligned(len(head) + structure.tell())
    frame = bytearray(native_frames.small_data(None, small, data_start, _small_data))
    view = memoryview(frame)
    view[: len(head)] = head
    view[len(head) : len(head) + structure.tell()] = structure.getbuffer()
    if small:
        native_frames.small_data(frame, small, data_start, _small_data)
    return frame, large


def _small_data(frame: bytearray | None, small: list[Tensor], at: int) -> int:
    """Each of the ``small`` tensors' bytes (plain CPU tensors: their elements as they are in
    memory) laid out from ``at``, into ``frame`` (None: only measured) by address: a numpy
    view of each would cost four of torch's and numpy's calls, each thousands of
    instructions. Returns where they end."""
    window = ctypes.c_char.from_buffer(frame) if frame is not None else None  # held meanwhile
    try:
        base = ctypes.addressof(window) if window is not None else 0
        for tensor in small:
            nbytes, at = tensor.nbytes, _aligned(at)
            if nbytes and window is not None:
                source = tensor if tensor.is_contiguous() else tensor.contiguous()
                ctypes.memmove(base + at, source.data_ptr(), nbytes)
            at += nbytes
    finally:
        del window
    return _aligned(at)


class _Reading(threading.local):
    """The frame being decoded on this thread: its data, where the next small tensor's data
    starts, how many small tensors were read, and its large tensors."""

    data: np.ndarray | None = None
    at: int = 0
    count: int = 0
    large: list[Tensor] | None = None


_READING = _Reading()


def _small_tensor(dtype_name: str, shape: tuple[int, ...]) -> Tensor:
    """A small tensor of the frame being decoded (see :func:`decode`): its next data, made
    by the compiled loops where they take tensors (else :func:`_small_tensor_by_numpy`)."""
    reading = _READING
    data = reading.data
    if data is None:
        raise FrameError("a frame's tensor outside a frame")
    made = native_frames.small_tensor(data, reading.at, dtype_name, shape, _small_tensor_by_numpy)
    if isinstance(made, str):
        if made == "unknown dtype":
            raise FrameError(f"a frame's tensor of an unknown dtype {dtype_name!r}")
        raise FrameError(made)
    tensor, reading.at = made
    reading.count += 1
    return tensor


def _small_tensor_by_numpy(
    data: np.ndarray, at: int, dtype_name: object, shape: object
) -> tuple[Tensor, int] | str:
    dtype = _DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if dtype is None:
        return "unknown dtype"
    if type(shape) is not tuple or not all(type(d) is int and d >= 0 for d in shape):
        return "a frame's tensor shape is not a tuple of sizes"
    start = _aligned(at)
    numel = 0 if 0 in shape else 1  # a size of 0 holds nothing, whatever the others claim
    for size in shape:
        numel *= size
        if numel > data.size:  # stop early: an absurd claim is slow to multiply out
            break
    end = start + numel * dtype.itemsize
    if end > data.size:
        return "a frame's tensors claim more data than it holds"
    if numel == 0:
        return torch.empty(shape, dtype=dtype), end
    # A numpy array over the frame's bytes, then a tensor of it: a fraction of the cost of
    # torch's slicing and views.
    tensor = torch.from_numpy(np.ndarray(shape, _NUMPY_DTYPES[dtype], data, start))
    return (tensor if dtype is not torch.bfloat16 else tensor.view(torch.bfloat16)), end


def _large_tensor(index: int) -> Tensor:
    """A large tensor of the frame being decoded: the one at ``index`` beside it."""
    large = _READING.large
    if large is None:
        raise FrameError("a frame's tensor outside a frame")
    if type(index) is not int or not 0 <= index < len(large):
        raise FrameError(f"a frame refers to large tensor {index!r} of {len(large)}")
    return large[index]


def _checked_header(frame: object, large: object) -> tuple[memoryview, int, int]:
    """A frame's view, its count of small tensors and where its structure ends, once its
    header and large tensors are checked (:class:`FrameError` saying what is wrong)."""
    if not isinstance(frame, bytearray | bytes | memoryview):
        raise FrameError(f"a frame is a bytearray, not {type(frame).__name__}")
    if not isinstance(large, list | tuple) or not all(
        type(t) is Tensor and _plain(t) for t in large
    ):
        raise FrameError("a frame's large tensors must be a list of plain CPU tensors")
    view = memoryview(frame).cast("B")
    if view.nbytes < _HEADER.size:
        raise FrameError(f"a frame of {view.nbytes} bytes is shorter than its header")
    magic, version, _, num_small, num_large, structure_bytes = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise FrameError(f"not a paramserver frame (it starts {bytes(magic)!r})")
    if version != VERSION:
        raise FrameError(
            f"a frame of version {version} from a peer of another paramserver release: "
            f"this process reads version {VERSION} (run one release in a job)"
        )
    if num_large != len(large):
        raise FrameError(f"a frame says {num_large} large tensors but {len(large)} came")
    structure_end = _HEADER.size + structure_bytes
    if structure_end > view.nbytes:
        raise FrameError("a frame's structure runs past its end")
    return view, num_small, structure_end


def decode(
    frame: bytearray | bytes | memoryview, large: list[Tensor] | tuple[Tensor, ...] = ()
) -> Any:
    """The message of :func:`encode`'s ``(frame, large)``; :class:`FrameError` where the frame
    is of another version or damaged."""
    view, num_small, structure_end = _checked_header(frame, large)
    data_start = min(_aligned(structure_end), view.nbytes)
    # A bytearray, or a writable view of one, is the receiver's (the RPC layer or a socket's
    # reader made it): its data is read in place.
    owned = view if not view.readonly else bytearray(view)
    data = np.frombuffer(owned, np.uint8)[data_start:]
    reading = _READING
    if reading.data is not None:
        raise FrameError("a frame decoded inside another")
    reading.data, reading.at, reading.count, reading.large = data, 0, 0, list(large)
    try:
        message = pickle.loads(view[_HEADER.size : structure_end])
        at, count = reading.at, reading.count
    except FrameError:
        raise
    except Exception as error:
        raise FrameError(f"a frame's structure cannot be read: {error}") from error
    finally:
        reading.data, reading.large = None, None
    if count != num_small:
        raise FrameError(f"a frame says {num_small} tensors but its structure holds {count}")
    if _aligned(at) != data.size:
        raise FrameError("a frame holds more data than its tensors")
    return message
