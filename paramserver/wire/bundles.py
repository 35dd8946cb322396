"""Many tensors as one on the wire: a ``{name: tensor}`` mapping travels as a :class:`Bundle`,
its tensors end to end in one, and arrives as views of it (:func:`bundled`, :func:`unbundled`).

TensorPipe ships every tensor as a buffer of its own, at tens of microseconds each way whatever
its size: a step of a model with many tables moves a few tensors per table, and one copy into a
bundle costs far less (``benchmarks/bench_wire.py``). :mod:`paramserver.wire.messages` bundles its
messages' mappings when they are pickled, those of :data:`BUNDLED_FROM` bytes or more: a frame
(:mod:`paramserver.wire.frames`) copies smaller tensors into its own data anyway, each once, where
a bundle would copy them twice and cost its own Python each way.

A peer's bundle is checked whole before anything of it is read: :func:`unbundled` never raises,
and gives a :class:`MalformedBundle` saying what is wrong with a malformed one.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from paramserver import native_frames
from paramserver.wire.frames import LARGE_BYTES

# A mapping's tensors in all below this travel as they are, inside the frame: the size from
# which a tensor travels beside a frame, as its own buffer.
BUNDLED_FROM = LARGE_BYTES


@dataclass(frozen=True)
class Bundle:
    """A message's ``{name: tensor}`` mapping as it travels: the tensors end to end in one,
    ``flat``, with each one's name and shape (see :func:`bundled`). Tensors of one width (their
    shapes equal past the first dimension: a table's ids, its rows) are joined along their first
    dimension, so the receiver's views are one split; others are flattened first."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    flat: Tensor


@dataclass(frozen=True)
class MixedBundle:
    """A mapping of tensors of several dtypes (a row's state: float slots, int64 counts, bool
    masks) as it travels: one :class:`Bundle` per dtype, and the names in the mapping's order."""

    names: tuple[str, ...]
    bundles: tuple[Bundle, ...]


@dataclass(frozen=True)
class MalformedBundle:
    """What a received field holds where its bundle was malformed: the receiver refuses the
    message (``malformed()``), saying why."""

    reason: str


def bundled(mapping: Any) -> Any:
    """A ``{name: tensor}`` mapping as it travels: a :class:`Bundle` where it holds two or more
    plain tensors (CPU, strided, no autograd) of one dtype, of :data:`BUNDLED_FROM` bytes or
    more in all, a :class:`MixedBundle` where they are of several, else itself (smaller
    mappings, encoded values and packed ids travel as they are)."""
    if type(mapping) is not dict or len(mapping) < 2:
        return mapping
    made = native_frames.bundle_values(list(mapping.values()), BUNDLED_FROM, _bundle_values)
    if made is None:
        return mapping
    if type(made) is not tuple:  # True: of several dtypes
        return _mixed_bundle(mapping) or mapping
    shapes, flat = made
    return Bundle(tuple(mapping), shapes, flat)


def _mixed_bundle(mapping: dict[str, Tensor]) -> MixedBundle | None:
    """A mapping of plain tensors of several dtypes as one bundle of each, or None where one
    is not on the CPU, say."""
    by_dtype: dict[torch.dtype, dict[str, Tensor]] = {}
    for name, value in mapping.items():
        by_dtype.setdefault(value.dtype, {})[name] = value
    bundles = []
    for part in by_dtype.values():
        made = native_frames.bundle_values(list(part.values()), 0, _bundle_values)
        if type(made) is not tuple:
            return None
        shapes, flat = made
        bundles.append(Bundle(tuple(part), shapes, flat))
    return MixedBundle(tuple(mapping), tuple(bundles))


def _bundle_values(values: list[Any], threshold: int) -> tuple[Any, Tensor] | bool | None:
    """:func:`paramserver.native_frames.bundle_values` in Python: ``values`` (a mapping's,
    one or more) as one bundle's shapes and flat tensor; True where they are plain tensors of
    several dtypes, of ``threshold`` bytes or more in all; None where not all are plain
    strided tensors, or they hold fewer bytes, or they are not on the CPU, say."""
    dtype, nbytes, one_dtype = getattr(values[0], "dtype", None), 0, True
    for value in values:  # one pass: a message's mappings are walked each call
        if type(value) is not Tensor or value.layout is not torch.strided:
            return None
        nbytes += value.nbytes
        one_dtype = one_dtype and value.dtype is dtype
    if nbytes < threshold:
        return None
    if not one_dtype:
        return True
    flat = joined_already(values)  # the views a split made: travel as what they split
    if flat is None:
        with torch.no_grad():
            flat = (
                torch.cat(values)
                if _one_width(values)
                else torch.cat([v.reshape(-1) for v in values])
            )
    if not _plain(flat):
        return None
    return tuple(tuple(value.shape) for value in values), flat


def joined_already(values: list[Tensor]) -> Tensor | None:
    """The tensor ``values`` already make up, end to end and in order, where they fill one
    storage whole (a split's views, as :func:`unbundled` makes them or rows read in one piece;
    gradients a backward wrote into one buffer): that storage, shaped as :func:`bundled` joins
    them. None where they do not. One call of the compiled loops, else :func:`_joined_by_torch`."""
    return native_frames.joined_tensors(values, _joined_by_torch)


def _joined_by_torch(values: list[Tensor]) -> Tensor | None:
    first = values[0]
    storage, dtype, itemsize = first.untyped_storage(), first.dtype, first.element_size()
    start = at = storage.data_ptr()
    # Each view must start where the last ended; that the last ends at the first one's
    # storage's end then proves every one inside that storage (an adjacent storage's views
    # would end past it), with no storage looked up per view.
    for value in values:
        if value.dtype is not dtype or not value.is_contiguous():
            return None
        numel = value.numel()
        if numel:
            if value.data_ptr() != at:
                return None
            at += numel * itemsize
    if at != start + storage.nbytes() or not first.is_cpu:
        return None
    whole = first.new_empty(0).set_(storage)
    if _one_width(values):
        return whole.view(-1, *first.shape[1:])
    return whole


def _one_width(values: list[Tensor]) -> bool:
    """Whether the tensors' shapes are equal past the first dimension (the common cases, 1-D
    and 2-D, without building each shape's tail)."""
    dims = values[0].dim()
    if dims == 0:
        return False
    if dims == 1:
        return all(value.dim() == 1 for value in values)
    if dims == 2:
        width = values[0].size(1)
        return all(value.dim() == 2 and value.size(1) == width for value in values)
    tail = values[0].shape[1:]
    return all(value.shape[1:] == tail for value in values)


def _plain(value: Any) -> bool:
    return (
        type(value) is Tensor
        and value.is_cpu
        and value.layout is torch.strided
        and not value.requires_grad
        and not value.is_quantized
    )


def unbundled(value: Any) -> Any:
    """A :class:`Bundle`'s or :class:`MixedBundle`'s mapping (views of their ``flat``
    tensors), a :class:`MalformedBundle` saying what is wrong with a malformed one, anything
    else as it is. Never raises: a peer's bundle is checked whole before it is read."""
    if type(value) is MixedBundle:
        return _mixed_unbundled(value)
    if type(value) is not Bundle:
        return value
    views = native_frames.unbundled_views(value.names, value.shapes, value.flat, _views)
    return MalformedBundle(views) if type(views) is str else views


def _views(names: Any, shapes: Any, flat: Any) -> dict[str, Tensor] | str:
    """A bundle's views by name, or what is wrong with it: in Python, where the loops do not
    take tensors."""
    problem = _bundle_problem(names, shapes, flat)
    if problem is not None:
        return problem
    parts: Sequence[Tensor] = ()
    if _as_rows(flat, shapes):
        parts = flat.split_with_sizes([shape[0] for shape in shapes]) if shapes else ()
    else:
        flat = flat.reshape(-1)
        numels = [math.prod(shape) for shape in shapes]
        views = zip(flat.split_with_sizes(numels), shapes, strict=True)
        parts = [part.view(shape) for part, shape in views]
    return dict(zip(names, parts, strict=True))


def _mixed_unbundled(value: MixedBundle) -> dict[str, Tensor] | MalformedBundle:
    names, bundles = value.names, value.bundles
    if type(names) is not tuple or not _all_of(str, names):
        return MalformedBundle("a bundle's names must be a tuple of strings")
    if type(bundles) is not tuple or not _all_of(Bundle, bundles):
        return MalformedBundle("a bundle of several dtypes must hold a tuple of bundles")
    found: dict[str, Tensor] = {}
    for bundle in bundles:
        part = unbundled(bundle)
        if type(part) is MalformedBundle:
            return part
        found.update(part)
    if len(found) != len(names) or found.keys() != set(names):
        return MalformedBundle("a bundle's names differ from those of the bundles it holds")
    return {name: found[name] for name in names}


def _as_rows(flat: Tensor, shapes: tuple[tuple[int, ...], ...]) -> bool:
    """Whether a bundle joined its tensors as rows (see :class:`Bundle`)."""
    width = flat.shape[1:]
    return flat.dim() > 0 and all(len(shape) and shape[1:] == width for shape in shapes)


def _bundle_problem(names: Any, shapes: Any, flat: Any) -> str | None:
    if type(names) is not tuple or not _all_of(str, names):
        return "a bundle's names must be a tuple of strings"
    if len(set(names)) != len(names):
        return "a bundle names a tensor twice"
    if type(flat) is not Tensor or flat.dim() == 0 or not _plain(flat):
        return "a bundle's values must be one plain tensor of 1 or more dimensions"
    if type(shapes) is not tuple or len(shapes) != len(names):
        return "a bundle must give one shape per name"
    if not _all_of(tuple, shapes):
        return "a bundle's shapes must be tuples of sizes"
    sizes = list(itertools.chain.from_iterable(shapes))  # every shape's, checked at once
    if not _all_of(int, sizes) or (sizes and (min(sizes) < 0 or max(sizes) > _LARGEST_SIZE)):
        return "a bundle's shapes must be tuples of sizes"
    return _size_problem(flat, shapes)


_LARGEST_SIZE = 2**63 - 1  # a tensor's sizes are int64s: even one of no elements has no larger


def _all_of(kind: type, items: Iterable[object]) -> bool:
    """Whether every one of ``items`` is exactly a ``kind`` (the walk in C: a peer's bundles
    are checked on every call)."""
    return set(map(type, items)) <= {kind}


def _size_problem(flat: Tensor, shapes: tuple[tuple[int, ...], ...]) -> str | None:
    """Whether ``shapes`` (tuples of sizes) claim exactly the values ``flat`` holds."""
    if _as_rows(flat, shapes):  # rows of the flat tensor's width: their counts must add up
        rows = sum(shape[0] for shape in shapes)
        if rows > flat.shape[0]:
            return "a bundle's shapes claim more values than it holds"
        return "a bundle holds more values than its shapes claim" if rows < flat.shape[0] else None
    remaining = flat.numel()
    for shape in shapes:
        size = 1
        for dim in shape:
            size *= dim
            if size > remaining:  # stop early: a claim of absurd size is slow to multiply out
                return "a bundle's shapes claim more values than it holds"
        remaining -= size
    return "a bundle holds more values than its shapes claim" if remaining else None
