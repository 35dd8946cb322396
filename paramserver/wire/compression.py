"""Lossy codecs for the tensors trainers and servers exchange, and error feedback.

Gradients pushed up and values pulled down are float32; a codec trades accuracy for bytes on
the wire. Per element of a float32 tensor ``x`` with decoded ``x̂``:

========  ===========================================  ==========================================
codec     bytes on the wire                            bound on ``|x - x̂|``
========  ===========================================  ==========================================
none      4 per element                                0
fp16      2 per element                                ``|x|·2^-11 + 2^-25``
bf16      2 per element                                ``|x|·2^-8 + 2^-126``
int8      1 per element + 2 per row (a bf16 scale)     ``scale_row·(1/2 + 2^-16)``
topk      8 per kept entry (12 past 2^31 elements)     0 where kept, ``|x|`` where dropped
========  ===========================================  ==========================================

Where the bounds come from:

* fp16 rounds to nearest with 11 significant bits: half an ulp is at most ``|x|·2^-11`` in the
  normal range and ``2^-25`` among fp16 subnormals. Above 65504 fp16 would overflow to inf, so a
  tensor with any ``|x| > 65504`` is sent as ``none`` instead: decoding never makes inf from a
  finite input.
* bf16 keeps 8 significant bits and float32's exponent range. A correctly rounded conversion
  (torch 2.13's on x86 CPUs) errs by at most ``2^-134`` on float32 subnormals; the bound uses
  ``2^-126`` (the smallest normal float32) so that it also holds for converters that flush
  subnormals to zero, as x86's AVX512-BF16 instructions do. Values past bfloat16's max (about
  3.39e38) would round to inf, so such tensors go as ``none``.
* int8 views the tensor as rows (a 2-D tensor's rows; 1-D and 0-d: one row; N-D: the first dim,
  the rest flattened), sends ``scale_row``, ``max|row| / 127`` rounded up to a bfloat16, and
  ``q = round(x / scale_row)`` in ``[-127, 127]``. Rounded up, the scale still covers the row's
  peak, and is at most ``2^-7`` of itself above ``max|row| / 127`` (bfloat16 keeps 8
  significant bits and float32's range; a float32 scale would add 2 bytes a row: an eighth of an
  int8 row of 16). Rounding to the integer costs ``scale_row/2``; the float32 division and the
  decoder's ``q·scale_row`` each round by at most ``127·2^-24`` of ``scale_row``, which
  ``2^-16`` covers. A nonzero scale below ``2^-126`` is raised to ``2^-126`` so that the
  division never runs on subnormals; a row of zeros has scale 0 and decodes to zeros. Tensors
  with ``|x|`` above float32 max / 128 go as ``none`` so ``q·scale`` cannot overflow.
* topk keeps the ``k = max(1, ceil(topk_ratio·numel))`` entries of largest magnitude (0 for an
  empty tensor) exactly and sends their flat indices, strictly increasing, as int32 (int64 when
  the tensor has more than 2^31 elements) plus float32 values.

Any non-finite input is sent as ``none`` by every codec, so a NaN or Inf reaches the server
intact and is rejected there rather than hidden by quantization.

Top-k alone does not train: the small coordinates it drops every step are never applied. Error
feedback (Seide et al., 1-bit SGD; Stich et al., sparsified SGD with memory) fixes that: the
sender keeps what it did not send (its *residual*) and adds it to the next gradient, so every
coordinate is sent once it has accumulated enough, and the sum of what was sent plus the residual
always equals the sum of the true gradients (see :class:`ErrorFeedback`).

A server must not trust an :class:`Encoded` from a peer: :func:`validate` checks one without
raising, and :func:`decode` is safe on anything it accepted. Each path accepts only the codecs
trainers use on it (their names: ``paramserver.config``): any of ``GRADIENT_CODECS`` for dense
gradients (top-k comes with error feedback there), ``VALUE_CODECS`` for embedding rows and
pooled vectors, whose top-k encoding no trainer sends and which would decode to a tensor far
larger than its message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from paramserver.config import GRADIENT_CODECS

_FP16_MAX = float(torch.finfo(torch.float16).max)
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)
_F32_TINY = float(torch.finfo(torch.float32).tiny)  # 2^-126, the smallest normal float32
_INT8_MAX_ABS = float(torch.finfo(torch.float32).max) / 128
_INT8_LEVELS = 127
_INT8_SLACK = 0.5 + 2.0**-16
_DENSE_DTYPES = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, eq=False)
class Encoded:
    """One encoded float32 tensor of ``shape``, as it travels (it pickles through torch RPC).

    ``tensors`` by codec: none, fp16, bf16: the values as float32, float16 or bfloat16, of
    ``shape``; int8: ``(q, scales)``, int8 ``[rows, cols]`` and bfloat16 ``[rows]``; topk:
    ``(indices, values)``, ``[k]`` strictly increasing flat indices and float32 values.
    """

    codec: str
    shape: tuple[int, ...]
    tensors: tuple[Tensor, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of payload tensor data: what dominates the wire."""
        return sum(t.numel() * t.element_size() for t in self.tensors)


def encode(codec: str, tensor: Tensor, *, topk_ratio: float = 0.01) -> Encoded:
    """Encode a float32 ``tensor`` of any shape with ``codec`` (one of :data:`GRADIENT_CODECS`).

    The result may share storage with ``tensor`` (always for ``none``): the caller must not
    modify ``tensor`` until the message is sent. ``topk_ratio`` in ``(0, 1]`` is the fraction
    of entries top-k keeps; it is checked for every codec so a bad flag fails early.
    """
    _check_codec(codec)
    _check_float32(tensor)
    if isinstance(topk_ratio, bool) or not isinstance(topk_ratio, int | float):
        raise ValueError(f"topk_ratio must be a number in (0, 1], got {type(topk_ratio).__name__}")
    if not 0.0 < topk_ratio <= 1.0:
        raise ValueError(f"topk_ratio must be in (0, 1], got {topk_ratio}")
    x = tensor.detach()
    if codec == "fp16" or codec == "bf16":
        limit = _FP16_MAX if codec == "fp16" else _BF16_MAX
        if not _peak(x) <= limit:  # also true for NaN
            return _as_none(x)
        return Encoded(codec, tuple(x.shape), (x.to(_DENSE_DTYPES[codec]),))
    if codec == "int8":
        return _encode_int8(x)
    if codec == "topk":
        return _encode_topk(x, topk_ratio)
    return _as_none(x)


def decode(encoded: Encoded) -> Tensor:
    """The float32 tensor of ``encoded.shape`` that ``encoded`` stands for.

    For ``none`` this is the payload tensor itself (no copy); otherwise a new tensor. Safe on
    any ``Encoded`` :func:`validate` accepted; on others it may raise anything.
    """
    codec, shape, tensors = encoded.codec, encoded.shape, encoded.tensors
    if codec == "none":
        return tensors[0]
    if codec == "fp16" or codec == "bf16":
        return tensors[0].float()
    if codec == "int8":
        q, scales = tensors
        return q.float().mul_(scales[:, None]).reshape(shape)
    if codec == "topk":
        indices, values = tensors
        out = torch.zeros(math.prod(shape), dtype=torch.float32)
        out[indices] = values
        return out.reshape(shape)
    raise ValueError(f"unknown codec {codec!r}; expected one of {', '.join(GRADIENT_CODECS)}")


def error_bound(codec: str, tensor: Tensor) -> Tensor:
    """Per-element float32 bound on ``|tensor - decode(encode(codec, tensor))|`` for a finite
    ``tensor`` (the bounds in the module docstring; for topk ``|x|``, whatever ``k`` is).

    Where ``encode`` falls back to ``none`` the true error is 0 and the bound still holds.
    """
    _check_codec(codec)
    _check_float32(tensor)
    x = tensor.detach().abs()
    if codec == "none":
        return torch.zeros_like(x)
    if codec == "fp16":
        return x * 2.0**-11 + 2.0**-25
    if codec == "bf16":
        return x * 2.0**-8 + _F32_TINY
    if codec == "int8":
        num_rows, num_cols = _rows_of(tuple(x.shape))
        scales = _int8_scales(_row_peaks(x.reshape(num_rows, num_cols)))
        per_row = (scales * _INT8_SLACK)[:, None].expand(num_rows, num_cols)
        return per_row.reshape(x.shape).clone()
    return x


def validate(
    encoded: object, shape: tuple[int, ...], codecs: tuple[str, ...] = GRADIENT_CODECS
) -> str | None:
    """None if ``encoded`` is a well-formed :class:`Encoded` in one of ``codecs`` that decodes
    to a finite float32 tensor of exactly ``shape``; otherwise a short reason. Never raises,
    whatever it is given; its work and memory grow with the payload, not with ``shape``.

    Meant for a server reading a peer's message; ``shape`` is the server's own (trusted).
    """
    if type(encoded) is not Encoded:
        return f"expected an Encoded, got {type(encoded).__name__}"
    shape = tuple(shape)
    problem = _header_problem(encoded, shape, codecs)
    if problem is not None:
        return problem
    codec, tensors = encoded.codec, encoded.tensors
    if codec == "int8":
        return _int8_problem(tensors[0], tensors[1], shape)
    if codec == "topk":
        return _topk_problem(tensors[0], tensors[1], math.prod(shape))
    return _plain_payload_problem(codec, tensors[0], shape)


def _header_problem(
    encoded: Encoded, shape: tuple[int, ...], codecs: tuple[str, ...]
) -> str | None:
    """What is wrong with ``encoded``'s codec, claimed shape or payload tensors, if anything
    (each payload tensor checked as a plain tensor; the codec's own rules come after)."""
    codec = getattr(encoded, "codec", None)
    claimed = getattr(encoded, "shape", None)
    tensors = getattr(encoded, "tensors", None)
    if type(codec) is not str or codec not in GRADIENT_CODECS:
        what = repr(codec[:32]) if type(codec) is str else type(codec).__name__
        return f"unknown codec {what}; expected one of {', '.join(GRADIENT_CODECS)}"
    if codec not in codecs:
        return f"codec {codec} is not used here; expected one of {', '.join(codecs)}"
    if type(claimed) is not tuple or not all(type(d) is int for d in claimed):
        return "shape must be a tuple of ints"
    if claimed != shape:
        return f"shape {_fmt_shape(claimed)} != expected {_fmt_shape(shape)}"
    if type(tensors) is not tuple:
        return f"payload must be a tuple of tensors, got {type(tensors).__name__}"
    expected_count = 2 if codec in ("int8", "topk") else 1
    if len(tensors) != expected_count:
        return f"{codec} takes {expected_count} payload tensor(s), got {len(tensors)}"
    return next(filter(None, (_plain_tensor_problem(t) for t in tensors)), None)


def _plain_payload_problem(codec: str, values: Tensor, shape: tuple[int, ...]) -> str | None:
    """fp16 / bf16 / none: one tensor of the codec's dtype and exactly ``shape``, finite."""
    if values.dtype != _DENSE_DTYPES[codec]:
        return f"{codec} payload must be {_DENSE_DTYPES[codec]}, got {values.dtype}"
    if tuple(values.shape) != shape:
        return f"payload shape {_fmt_shape(tuple(values.shape))} != {_fmt_shape(shape)}"
    if not _all_finite(values):
        return "payload contains NaN or Inf"
    return None


def plain(value: Tensor | Encoded) -> Tensor:
    """``value`` itself if a tensor, else decoded (for values from a trusted sender)."""
    return decode(value) if isinstance(value, Encoded) else value


class ErrorFeedback:
    """Compresses a sender's tensors by name, carrying what each message lost into the next.

    ``compress`` sends ``corrected = grad + residual`` and keeps ``corrected - decode(sent)`` as
    the new residual, so after any sequence ``g_1..g_T``::

        sum_t decode(sent_t) + residual_T == sum_t g_t

    up to float32 rounding of the additions (about ``2^-24`` of the magnitudes involved, per
    step). With ``none`` the residual is zero after each call. Not thread-safe: one instance per
    sending thread. Residuals are float32, on the gradients' device, one per name.
    """

    def __init__(self) -> None:
        self._residuals: dict[str, Tensor] = {}

    def compress(self, name: str, grad: Tensor, codec: str, topk_ratio: float = 0.01) -> Encoded:
        """Encode ``grad + residual(name)`` and update the residual.

        The residual starts at zeros; a ``grad`` whose shape differs from the residual's raises
        ``ValueError``, as do the errors of :func:`encode`. On any error the residual is
        unchanged. The result may share storage with ``grad`` (see :func:`encode`).
        """
        _check_codec(codec)
        _check_float32(grad)
        grad = grad.detach()
        residual = self._residuals.get(name)
        if residual is None:
            corrected = grad
        elif residual.shape != grad.shape:
            raise ValueError(
                f"gradient {name!r} changed shape from {tuple(residual.shape)} to "
                f"{tuple(grad.shape)}; error feedback needs a fixed shape per name"
            )
        else:
            corrected = grad + residual
        encoded = encode(codec, corrected, topk_ratio=topk_ratio)
        self._residuals[name] = corrected - decode(encoded)
        return encoded

    def residual(self, name: str) -> Tensor:
        """A copy of the residual of ``name``; ``KeyError`` if ``name`` was never compressed."""
        return self._residuals[name].clone()


# ---- helpers ----


def _check_codec(codec: str) -> None:
    if codec not in GRADIENT_CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {', '.join(GRADIENT_CODECS)}")


def _check_float32(tensor: Tensor) -> None:
    if not isinstance(tensor, Tensor) or tensor.dtype != torch.float32:
        what = tensor.dtype if isinstance(tensor, Tensor) else type(tensor).__name__
        raise ValueError(f"codecs take float32 tensors, got {what}")


def _as_none(x: Tensor) -> Encoded:
    return Encoded("none", tuple(x.shape), (x,))


def _peak(x: Tensor) -> float:
    """max |x| (NaN if any NaN), 0 for an empty tensor."""
    return float(torch.linalg.vector_norm(x, math.inf)) if x.numel() else 0.0


def _rows_of(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) < 2:
        return 1, math.prod(shape)
    return shape[0], math.prod(shape[1:])


def _row_peaks(rows: Tensor) -> Tensor:
    if rows.shape[1] == 0:  # the inf-norm of an empty row is undefined in torch
        return torch.zeros(rows.shape[0], dtype=rows.dtype, device=rows.device)
    return torch.linalg.vector_norm(rows, math.inf, dim=1)


def _int8_scales(peaks: Tensor) -> Tensor:
    """Each row's scale, as float32 holding a bfloat16 value exactly: ``peak / 127`` (at least
    ``2^-126``) rounded up to a bfloat16; 0 for a row of zeros."""
    scales = (peaks / _INT8_LEVELS).clamp_min_(_F32_TINY)
    # A positive float32 rounds up to bfloat16 by carrying its low 16 bits into the high 16:
    # no overflow, as scales stay far below float32 max (see _INT8_MAX_ABS).
    scales.view(torch.int32).add_(0xFFFF).bitwise_and_(-0x10000)
    return torch.where(peaks > 0, scales, torch.zeros_like(scales))


def _encode_int8(x: Tensor) -> Encoded:
    shape = tuple(x.shape)
    num_rows, num_cols = _rows_of(shape)
    rows = x.reshape(num_rows, num_cols)
    peaks = _row_peaks(rows)
    if peaks.numel() and not float(peaks.max()) <= _INT8_MAX_ABS:  # also true for NaN
        return _as_none(x)
    scales = _int8_scales(peaks)
    divisors = torch.where(scales > 0, scales, torch.ones_like(scales))
    # |x / scale| <= 127 up to rounding, so the clamp only guards the int8 cast.
    q = torch.round(rows / divisors[:, None]).clamp_(-_INT8_LEVELS, _INT8_LEVELS)
    return Encoded("int8", shape, (q.to(torch.int8), scales.to(torch.bfloat16)))


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= 2**31 else torch.int64


def _encode_topk(x: Tensor, ratio: float) -> Encoded:
    numel = x.numel()
    k = min(numel, max(1, math.ceil(ratio * numel)))
    flat = x.reshape(-1)
    # torch.topk ranks NaN above every number, so a NaN input is always among the kept values.
    indices = torch.topk(flat.abs(), k, sorted=False).indices.sort().values
    values = flat[indices]
    if not _all_finite(values):
        return _as_none(x)
    return Encoded("topk", tuple(x.shape), (indices.to(_index_dtype(numel)), values))


def _all_finite(t: Tensor) -> bool:
    # A finite sum proves every element finite (NaN and Inf propagate); only an overflowing sum
    # needs the element-wise check.
    if t.numel() == 0 or math.isfinite(float(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def _fmt_shape(shape: tuple[int, ...]) -> str:
    if len(shape) <= 8:
        return str(shape)
    return f"({', '.join(map(str, shape[:8]))}, ... {len(shape)} dims)"


def _plain_tensor_problem(t: object) -> str | None:
    if type(t) is not Tensor:
        return f"payload must hold plain tensors, got {type(t).__name__}"
    if t.layout != torch.strided or not t.is_cpu or t.requires_grad or t.is_nested:
        return "payload tensors must be dense CPU tensors without autograd"
    return None


def _int8_problem(q: Tensor, scales: Tensor, shape: tuple[int, ...]) -> str | None:
    num_rows, num_cols = _rows_of(shape)
    if q.dtype != torch.int8 or tuple(q.shape) != (num_rows, num_cols):
        return f"int8 values must be int8 of shape ({num_rows}, {num_cols})"
    if scales.dtype != torch.bfloat16 or tuple(scales.shape) != (num_rows,):
        return f"int8 scales must be bfloat16 of shape ({num_rows},)"
    if q.numel() and int(q.min()) < -_INT8_LEVELS:
        return f"int8 values must lie in [-{_INT8_LEVELS}, {_INT8_LEVELS}]"
    # 127·scale finite bounds every decoded q·scale; NaN fails both tests.
    if not bool((scales >= 0).all()) or not _all_finite(scales.float() * _INT8_LEVELS):
        return "int8 scales must be finite, >= 0 and small enough that 127·scale is finite"
    return None


def _topk_problem(indices: Tensor, values: Tensor, numel: int) -> str | None:
    if indices.dtype != _index_dtype(numel) or indices.dim() != 1:
        return f"topk indices must be 1-D {_index_dtype(numel)}"
    if values.dtype != torch.float32 or tuple(values.shape) != tuple(indices.shape):
        return "topk values must be float32, one per index"
    k = indices.numel()
    if k > numel:
        return f"topk sends {k} entries of a tensor of {numel}"
    if k and (int(indices[0]) < 0 or int(indices[-1]) >= numel):
        return f"topk index outside [0, {numel})"
    if k > 1 and not bool((indices[1:] > indices[:-1]).all()):
        return "topk indices must be strictly increasing"
    if not _all_finite(values):
        return "topk values contain NaN or Inf"
    return None
