"""A message's tensors by the compiled loops, where they take tensors (:mod:`paramserver.native`
says when; built beside torch, ``_tensors.cpp``), else by the caller's own Python, which it
hands in: :mod:`paramserver.wire.frames` (a tensor's reduction, the small tensors' data, a
decoded small tensor), :mod:`paramserver.wire.bundles` (views that lie end to end) and
:mod:`paramserver.wire.sizing` (a message's tensor data, walked). In Python each costs a dozen
of torch's or the interpreter's calls per tensor, thousands of instructions; in C++ tens. Both
paths give the same results (the tests run both)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np
from torch import Tensor

from paramserver import native


def joined_tensors(
    values: list[Tensor], fallback: Callable[[list[Tensor]], Tensor | None]
) -> Tensor | None:
    """The tensor ``values`` make up end to end and in order, where they fill one storage
    whole (see :func:`paramserver.wire.bundles.joined_already`), else None: their pointers and
    sizes read in one call of the loops."""
    if not native.takes_tensors():
        return fallback(values)
    return cast(Tensor | None, native.loops.joined_tensors(values))  # type: ignore[union-attr]


def frame_reducer(
    small: list[Tensor], large: list[Tensor], small_fn: object, large_fn: object, large_bytes: int
) -> Callable[[object], Any] | None:
    """A frame pickler's ``reducer_override`` in one call of the loops: a plain tensor's
    reduction, ``(small_fn, (dtype name, shape))`` once it is put in ``small`` or
    ``(large_fn, (index,))`` once it (or a copy of a view's elements) is put in ``large``
    (from ``large_bytes``); anything else NotImplemented. None where the loops do not take
    tensors (the frame's own Python does it)."""
    if not native.takes_tensors():
        return None
    loops = native.loops
    assert loops is not None
    return functools.partial(loops.frame_tensor, small, large, small_fn, large_fn, large_bytes)


def small_data(
    frame: bytearray | None,
    small: list[Tensor],
    at: int,
    fallback: Callable[[bytearray | None, list[Tensor], int], int],
) -> int:
    """The ``small`` tensors' bytes (their elements in order) laid out from ``at``, each from
    an offset aligned to 8, copied into ``frame`` (None: only measured); where they end,
    aligned too."""
    if not native.takes_tensors():
        return fallback(frame, small, at)
    return int(native.loops.small_data(frame, small, at))  # type: ignore[union-attr]


def small_tensor(
    data: np.ndarray,
    at: int,
    dtype_name: object,
    shape: object,
    fallback: Callable[[np.ndarray, int, object, object], tuple[Tensor, int] | str],
) -> tuple[Tensor, int] | str:
    """A frame's small tensor: a writable view of ``data`` (uint8) from ``at`` aligned to 8,
    of the dtype a frame names ``dtype_name`` and of ``shape``, and where its data ends; or
    why there is none (``"unknown dtype"``, or what is wrong with the shape or the claim)."""
    if not native.takes_tensors():
        return fallback(data, at, dtype_name, shape)
    made = native.loops.frame_small_tensor(data, at, dtype_name, shape)  # type: ignore[union-attr]
    return cast(tuple[Tensor, int] | str, made)


def bundle_values(
    values: list[Any],
    threshold: int,
    fallback: Callable[[list[Any], int], tuple[Any, Tensor] | bool | None],
) -> tuple[Any, Tensor] | bool | None:
    """A mapping's ``values`` (one or more) as one bundle, in one call of the loops: each
    one's shape and them end to end (the storage they fill already, else a copy), as
    ``(shapes, flat)``; True where they are plain tensors of several dtypes, of ``threshold``
    bytes or more in all (a bundle each); None where they travel as they are."""
    if not native.takes_tensors():
        return fallback(values, threshold)
    return cast(tuple[Any, Tensor] | bool | None, native.loops.bundle_values(values, threshold))  # type: ignore[union-attr]


def unbundled_views(
    names: object,
    shapes: object,
    flat: object,
    fallback: Callable[[Any, Any, Any], dict[str, Tensor] | str],
) -> dict[str, Tensor] | str:
    """A peer's bundle (its ``names``, ``shapes`` and ``flat`` tensor) checked whole, then its
    views by name; or what is wrong with it, in :mod:`paramserver.wire.bundles`' words. Never
    raises."""
    if not native.takes_tensors():
        return fallback(names, shapes, flat)
    return cast(dict[str, Tensor] | str, native.loops.unbundled_views(names, shapes, flat))  # type: ignore[union-attr]


def payload_sizes(
    message: object,
    special: dict[type, Callable[[Any], tuple[int, int]]],
    field_names: Callable[[type], tuple[str, ...]],
    fallback: Callable[[object], tuple[int, int]],
) -> tuple[int, int]:
    """A message's tensor data as sent and uncompressed, walked through its dicts, lists,
    tuples, dataclasses (their fields by ``field_names``) and other mappings, in one call of
    the loops: a tensor by its bytes, an object whose type ``special`` holds by its function.
    ``fallback`` where a count passes int64 (a peer's claim) or the loops take no tensors."""
    if not native.takes_tensors():
        return fallback(message)
    sizes = native.loops.payload_sizes(special, field_names, Mapping, message)  # type: ignore[union-attr]
    return fallback(message) if sizes is None else cast(tuple[int, int], sizes)
