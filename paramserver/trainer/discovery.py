"""Which of a call's inputs each lookup reads: a step's ids without running the model again.

Before a step, a trainer must know the ids its tables will look up. The record pass learns them
by running the model's forward (see :mod:`paramserver.trainer.replica`), which costs a good part
of a small model's step. Most recommendation models look up an input as it is
(``self.item(ids)``), a column of one (``table(sparse[:, i])``) or a row of one
(``table(ids[i])``): the lookup's ids are then a view of a tensor the forward was called with.

:class:`InputLookups` watches the record passes. Where every lookup of a forward is such a view
(found by the storage they share, and the view's offset and strides), in the same order two
passes running, and the second pass's ids are what the first's derivation gives for it, it
takes each later step's ids straight from the call's inputs (:meth:`InputLookups.derive`).
It falls back to record passes for good where it cannot know: a lookup computed from an input
(``ids + 1``, a hash), one that is not an input at all, or a forward whose lookups then differ
from what was derived (:meth:`InputLookups.missed`: the forward's own lookups always read the
right rows, as a lookup the record pass missed does; only speed is lost).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

Path = tuple[Any, ...]  # where a tensor sits in a call: ("arg", i[, j]) or ("kwarg", name[, j])


@dataclass(frozen=True)
class Derivation:
    """One lookup's ids as a view of one input: the input itself (``axis`` None), or its
    ``index``-th slice along ``axis`` 1 (a column) or 0 (a row) of a 2-D input."""

    table: str
    path: Path
    axis: int | None = None
    index: int = 0

    def ids_of(self, inputs: dict[Path, Tensor]) -> Tensor | None:
        tensor = inputs.get(self.path)
        if tensor is None:
            return None
        if self.axis is None:
            return tensor
        if tensor.dim() != 2 or self.index >= tensor.shape[self.axis]:
            return None
        return tensor.select(self.axis, self.index)


def call_tensors(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[Path, Tensor]:
    """The integer tensors a call was given, by where they sit (lists and tuples of them too)."""
    found: dict[Path, Tensor] = {}
    items: list[tuple[Path, Any]] = [(("arg", i), a) for i, a in enumerate(args)]
    items += [(("kwarg", k), v) for k, v in kwargs.items()]
    for path, value in items:  # the ids test inline: a call per input adds up each step
        if isinstance(value, list | tuple):
            for j, part in enumerate(value):
                if isinstance(part, Tensor) and part.dtype in _ID_DTYPES:
                    found[(*path, j)] = part
        elif isinstance(value, Tensor) and value.dtype in _ID_DTYPES:
            found[path] = value
    return found


_ID_DTYPES = (torch.int64, torch.int32)


def derivation_of(table: str, ids: Tensor, inputs: dict[Path, Tensor]) -> Derivation | None:
    """How ``ids`` (a lookup's input) is a view of one of ``inputs``, if it is."""
    storage = ids.untyped_storage().data_ptr()
    for path, tensor in inputs.items():
        if tensor.untyped_storage().data_ptr() != storage or tensor.dtype != ids.dtype:
            continue
        geometry = (ids.shape, ids.stride(), ids.storage_offset())
        if geometry == (tensor.shape, tensor.stride(), tensor.storage_offset()):
            return Derivation(table, path)
        if tensor.dim() == 2 and ids.dim() == 1:
            offset = ids.storage_offset() - tensor.storage_offset()
            for axis in (1, 0):
                other = 1 - axis  # the dimension the slice runs along
                step = tensor.stride(axis)
                if (
                    ids.shape[0] == tensor.shape[other]
                    and ids.stride(0) == tensor.stride(other)
                    and step > 0
                    and offset % step == 0
                    and 0 <= offset // step < tensor.shape[axis]
                ):
                    return Derivation(table, path, axis, offset // step)
    return None


class InputLookups:
    """Learns from record passes whether a model's lookups are views of its inputs, and then
    derives them (see the module docstring). One per replica; not thread-safe."""

    def __init__(self) -> None:
        self.derivations: tuple[Derivation, ...] | None = None  # of the last pass
        self.derived = False  # derive() answers
        self.unknowable = False  # stopped trying for good

    def derive(self, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, list[Tensor]] | None:
        """Each table's lookups' ids for a call with these arguments, in the order the
        forward makes them; None where they must be recorded."""
        if not self.derived or self.derivations is None:
            return None
        inputs = call_tensors(args, kwargs)
        derived: dict[str, list[Tensor]] = {}
        for derivation in self.derivations:
            ids = derivation.ids_of(inputs)
            if ids is None:  # this call is shaped otherwise: record it
                return None
            derived.setdefault(derivation.table, []).append(ids)
        return derived

    def learn(
        self, args: Sequence[Any], kwargs: dict[str, Any], lookups: Sequence[tuple[str, Tensor]]
    ) -> None:
        """A record pass of a call with these arguments made ``lookups`` (table, ids), in
        order: learn how they derive from the arguments."""
        if self.unknowable or self.derived or not lookups:
            return
        inputs = call_tensors(args, kwargs)
        found = [derivation_of(table, ids, inputs) for table, ids in lookups]
        if any(d is None for d in found):
            self.unknowable = True
            return
        derivations = tuple(d for d in found if d is not None)
        if derivations == self.derivations and self._gives(derivations, inputs, lookups):
            self.derived = True
        self.derivations = derivations

    @staticmethod
    def _gives(
        derivations: tuple[Derivation, ...],
        inputs: dict[Path, Tensor],
        lookups: Sequence[tuple[str, Tensor]],
    ) -> bool:
        for derivation, (_, ids) in zip(derivations, lookups, strict=True):
            derived = derivation.ids_of(inputs)
            if derived is None or not torch.equal(derived, ids):
                return False
        return True

    def missed(self) -> None:
        """A forward looked up ids that were not derived: record passes from now on."""
        self.derived, self.unknowable = False, True
