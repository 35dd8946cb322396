"""A trainer's working copy of the user's model, with embedding layers made remote.

Every table (the weight of an ``nn.Embedding``, ``nn.EmbeddingBag`` or ``DynamicEmbedding``)
becomes a :class:`~paramserver.trainer.remote.RemoteEmbedding` that looks ids up in the rows
pulled for the current step: a leaf tensor ``rows`` (requires grad) holding the unique ids the
step touches, sorted. After backward, ``rows.grad`` is exactly the gradient of those rows, so a
push carries only touched rows. Other layers sharing the weight become views of the table, and
the weight itself reads as a placeholder that ``F.embedding`` and ``F.embedding_bag`` look up
(see :mod:`paramserver.trainer.remote`).

To know which ids a step touches before the forward pass, the replica runs a *record pass*:
the model's forward in eval mode without autograd, where remote embeddings only record their
ids and return zeros. Once the first pass has shown how many lookups each table makes per
forward, later record passes stop as soon as they have them all. If a real forward ever meets an
id the record pass missed, it raises :class:`MissingRows`; the training loop pulls those rows and
runs the forward again, so a model whose lookups vary never trains on wrong rows. A lookup of
the very ids the record pass saw (the usual case) takes their rows' positions from it rather than
searching the pulled ids again; with the compiled loops, those lookups of all tables are made in
one autograd node (:class:`StepLookups`).

Table names are the state_dict names of the embedding weights (``emb.0.weight``), dense
parameter names are their state_dict names: an export loads into the user's model as is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from paramserver import native
from paramserver.errors import ModelError
from paramserver.trainer.discovery import InputLookups
from paramserver.trainer.gradmode import without_grad
from paramserver.trainer.lookups import (
    Recorded,
    RecordedLookups,
    Recorder,
    RecordingDone,
    StepLookups,
    unique_lookups,
)
from paramserver.trainer.remote import MissingRows, remote_tables
from paramserver.types import Inputs, as_tuple
from paramserver.wire.messages import BagBlock


@dataclass(frozen=True)
class Call:
    """The arguments of one call of the model."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, inputs: Any) -> Call:
        """A batch's inputs as a call: a tuple or list is the positional arguments, anything
        else the one argument."""
        return cls(as_tuple(inputs))


Fetch = Callable[[dict[str, Tensor]], dict[str, tuple[Tensor, Tensor]]]
"""Reads rows: per table, sorted unique ids -> ``(ids, rows)``."""


class _Registrations:
    """How many parameters and modules any module in this process has registered: while the
    count stands, no model's set of parameters has changed (a parameter is added or replaced
    by registering it, a submodule by registering it), so a check of a model's parameters
    need not walk them again."""

    count = 0

    @classmethod
    def seen(cls, *_: Any) -> None:
        cls.count += 1


nn.modules.module.register_module_parameter_registration_hook(_Registrations.seen)
nn.modules.module.register_module_module_registration_hook(_Registrations.seen)


class Replica:
    """The trainer's model with remote tables, and the moves of one step: record ids, load
    pulled values, run forward, collect gradients."""

    def __init__(self, model: nn.Module, server_pooling: Sequence[str] = ()):
        model, self.tables = remote_tables(model)
        self.model = model
        for name in server_pooling:
            self.tables[name].pool_on_servers()
        self.dense = dict(model.named_parameters())
        # The registrations counted when the model's parameters were found to be these.
        self._dense_as_of: int | None = _Registrations.count
        self._modules = list(model.modules())
        self._lookups_per_forward: dict[str, int] | None = None
        self._forward = model.forward  # the model's own, whatever route_forward installs
        self._recording_pass = False
        self._step_lookups = StepLookups(self.tables)
        self.inputs = InputLookups()  # lookups derived from the inputs, where it can
        for remote in self.tables.values():
            remote.step_lookups = self._step_lookups

    def route_forward(self, forward: Callable[[Call], Any]) -> None:
        """Have calls of the model (``model(...)``, after its hooks) go to ``forward``, except
        this replica's own record passes and forwards."""

        def routed(*args: Any, **kwargs: Any) -> Any:
            if self._recording_pass:
                return self._forward(*args, **kwargs)
            return forward(Call(args, kwargs))

        self.model.forward = routed

    def remove_forward(self) -> None:
        """Undo :meth:`route_forward`."""
        self.model.__dict__.pop("forward", None)

    @torch.no_grad()
    def load_buffers(self, buffers: dict[str, Tensor]) -> None:
        """Set the model's buffers to ``buffers`` (those of the servers' seeded build)."""
        for name, buffer in self.model.named_buffers():
            if name not in buffers:
                raise ModelError(f"the servers' model has no buffer {name!r}")
            buffer.copy_(buffers[name])

    # ---- before the step: which rows ----

    def record_ids(self, batches: Sequence[Inputs]) -> dict[str, Tensor]:
        """The sorted unique ids each table (not pooled on the servers) will look up."""
        return self.record([Call.of(inputs) for inputs in batches]).ids

    def record(self, calls: Sequence[Call]) -> Recorded:
        """What ``calls`` of the model will look up: the sorted unique ids of each row-pulled
        table with its lookups, and the bags of each server-pooled table (these allow one
        call per step)."""
        recorded: dict[str, list[Tensor]] = {}
        bags: dict[str, BagBlock] = {}
        if not self.tables:  # nothing to look up: no pass (it would be a whole forward)
            return Recorded({}, {}, {})
        # Tables some of whose ids were derived from the inputs (int32 or int64 tensors, the
        # only ones discovery finds), checked once they are sorted unique: by their ends.
        derived_tables: set[str] = set()
        for call in calls:
            derived = self.inputs.derive(call.args, call.kwargs)
            if derived is not None:  # the lookups are views of the inputs: no pass
                for table, each in derived.items():
                    recorded.setdefault(table, []).extend(ids.reshape(-1) for ids in each)
                derived_tables.update(derived)
                continue
            recorder = Recorder(self._lookups_per_forward)
            with self._recording(recorder), torch.no_grad(), suppress(RecordingDone):
                self.model(*call.args, **call.kwargs)
            if self._lookups_per_forward is None:
                self._lookups_per_forward = {t: len(v) for t, v in recorder.ids.items()}
            if recorder.bags and len(calls) > 1:
                raise ModelError("server-pooled tables take one batch per step (accumulate 1)")
            if recorder.bags:  # pooled bags need offsets and weights: always recorded
                self.inputs.unknowable = True
            self.inputs.learn(call.args, call.kwargs, recorder.in_order)
            self._step_lookups.learn_bags(call.args, call.kwargs, recorder)
            bags.update(recorder.bags)
            for table, each in recorder.ids.items():
                if table not in recorder.bags:
                    recorded.setdefault(table, []).extend(each)
        unique, lookups = unique_lookups(recorded)
        self._check_ranges(unique, derived_tables)
        return Recorded(unique, bags, lookups)

    def _check_ranges(self, unique: dict[str, Tensor], tables: set[str]) -> None:
        """Raise :class:`InvalidBatchError` unless each of ``tables``' sorted unique ids are
        its rows: all tables in one compiled call, the error (naming the table and the id)
        from a look at each where one is not."""
        bounded, ids, bounds = [], [], []
        for table in tables:
            rows = self.tables[table].num_embeddings
            if rows is not None:  # dynamic: every id is valid
                bounded.append(table)
                ids.append(unique[table])
                bounds.append((0, rows - 1))
        if not native.ascending_within(ids, bounds, _ends_within):
            for table in bounded:
                self.tables[table].check_range(unique[table], ascending=True)

    @contextmanager
    def _recording(self, recorder: Recorder) -> Iterator[None]:
        """Record lookups in eval mode (no dropout draws, no batch-norm statistics updates).

        The modes are flipped in place rather than with ``eval()``/``train()``, whose recursive
        walks cost more than a small model's whole record pass.
        """
        modes = [module.training for module in self._modules]
        for module in self._modules:
            module.__dict__["training"] = False
        for remote in self.tables.values():
            remote.recorder = recorder
        self._recording_pass = True
        try:
            yield
        finally:
            self._recording_pass = False
            for remote in self.tables.values():
                remote.recorder = None
            for module, mode in zip(self._modules, modes, strict=True):
                module.__dict__["training"] = mode

    # ---- the step ----

    @without_grad
    def load(
        self,
        dense: dict[str, Tensor],
        rows: dict[str, tuple[Tensor, Tensor]],
        pooled: dict[str, tuple[Tensor, BagBlock]] | None = None,
        lookups: dict[str, RecordedLookups] | None = None,
    ) -> None:
        """Copy pulled dense values in and install fresh leaves for the pulled rows (with the
        ``lookups`` recorded for them) and, for server-pooled tables, the pooled sums of their
        bags."""
        pooled = pooled or {}
        for name, remote in self.tables.items():
            if not remote.server_pooled:
                continue
            if name not in pooled:  # not looked up this step: nothing stale may be reused
                remote.pooled, remote.pooled_bags = torch.empty(0, remote.embedding_dim), None
                continue
            sums, remote.pooled_bags = pooled[name]
            remote.pooled = sums.requires_grad_(True)
        for name, value in dense.items():
            self.dense[name].copy_(value)
        for param in self.dense.values():
            param.grad = None
        self._load_rows(rows, lookups or {})

    def _load_rows(
        self, rows: dict[str, tuple[Tensor, Tensor]], lookups: dict[str, RecordedLookups]
    ) -> None:
        for name, remote in self.tables.items():
            pulled = rows.get(name)  # a table not looked up this step gets no rows
            ids, values = pulled if pulled is not None else _no_rows(remote.embedding_dim)
            remote.set_rows(ids, values.requires_grad_(True), lookups.get(name))

    def add_rows(self, table: str, ids: Tensor, values: Tensor) -> None:
        """Merge extra pulled rows into ``table``'s leaf, keeping gradients already accumulated."""
        remote = self.tables[table]
        merged_ids, inverse = torch.unique(torch.cat([remote.ids, ids]), return_inverse=True)
        old_positions = inverse[: remote.ids.numel()]
        merged = torch.empty(merged_ids.numel(), remote.embedding_dim, dtype=values.dtype)
        merged[old_positions] = remote.rows.detach()
        merged[inverse[remote.ids.numel() :]] = values
        old_grad = remote.rows.grad
        merged.requires_grad_(True)
        if old_grad is not None:
            merged.grad = torch.zeros_like(merged)
            merged.grad[old_positions] = old_grad
        remote.set_rows(merged_ids, merged)

    def forward(self, inputs: Inputs) -> Tensor:
        return self.model(*as_tuple(inputs))

    def forward_fetching(self, call: Call, fetch: Fetch) -> Any:
        """The model's own forward on ``call``, reading with ``fetch`` (ids -> ``(ids, rows)``
        per table) the rows a lookup misses (the record pass missed it: the model's lookups
        vary), then again."""
        derived = self.inputs.derived
        unmatched = self._unmatched() if derived else 0
        try:
            lookups = self._step_lookups
            while True:
                lookups.begin(call.args, call.kwargs)
                try:
                    output = self._forward(*call.args, **call.kwargs)
                except MissingRows as missing:
                    lookups.end(completed=False)
                    ids = missing.ids
                    self.tables[missing.table].check_range(ids)
                    self.add_rows(missing.table, *fetch({missing.table: ids})[missing.table])
                    continue
                except BaseException:
                    lookups.end(completed=False)
                    raise
                lookups.end(completed=True)
                return output
        finally:
            if derived and self._unmatched() != unmatched:  # not what was derived
                self.inputs.missed()

    def _unmatched(self) -> int:
        count = 0
        for remote in self.tables.values():  # (a loop: twice a step, a generator's calls)
            count += remote.unmatched
        return count

    def look(self, call: Call, fetch: Fetch) -> Any:
        """The model's own forward on ``call`` as a read outside the step: the rows it looks
        up are read with ``fetch`` (every table as rows, pooled on the servers or not), and
        the step's rows, pooled sums and their gradients are left as they were."""
        saved = [
            (r, r.ids, r.rows, r.lookups, r.pooled, r.pooled_bags, r.server_pooled)
            for r in self.tables.values()
        ]
        try:
            for remote in self.tables.values():
                remote.server_pooled = False
            recorded = self.record([call])
            self._load_rows(fetch(recorded.ids), recorded.lookups)
            return self.forward_fetching(call, fetch)
        finally:
            for remote, ids, rows, lookups, pooled, bags, server_pooled in saved:
                remote.ids, remote.rows, remote.lookups, remote.pooled = ids, rows, lookups, pooled
                remote.pooled_bags, remote.server_pooled = bags, server_pooled

    def gradients(self) -> tuple[dict[str, Tensor], dict[str, tuple[Tensor, Tensor]]]:
        """Dense gradients (parameters without a gradient are left out) and, per table, the
        touched ids with their gradient rows."""
        dense = {n: p.grad for n, p in self.dense.items() if p.grad is not None}
        rows = {}
        for name, remote in self.tables.items():
            if remote.ids.numel() and remote.rows.grad is not None:
                rows[name] = (remote.ids, remote.rows.grad)
        return dense, rows

    def pooled_gradients(self) -> dict[str, Tensor]:
        """Per server-pooled table, the gradient of its pooled sums."""
        return {
            name: remote.pooled.grad
            for name, remote in self.tables.items()
            if remote.server_pooled and remote.pooled.grad is not None
        }

    @torch.no_grad()
    def scale_gradients(self, factor: float) -> None:
        """Multiply every gradient of this step (parameters, rows, pooled sums) by ``factor``."""
        grads = [leaf.grad for leaf in self.grad_tensors()]
        for grad in [*grads, *self.pooled_gradients().values()]:
            grad.mul_(factor)  # type: ignore[union-attr]

    def has_gradients(self) -> bool:
        """Whether a backward has left a gradient on any parameter, row or pooled sum."""
        for param in self.dense.values():
            if param.grad is not None:
                return True
        for remote in self.tables.values():
            if remote.rows.grad is not None:
                return True
        return bool(self.pooled_gradients())

    def unknown_parameters_with_grad(self) -> list[str]:
        """Parameters of the model with a gradient that are not the ones it was built with
        (added or replaced since): the servers do not know them. Walks the model's
        parameters only after a registration anywhere in the process since they were last
        found to be the ones it was built with."""
        if self._dense_as_of == _Registrations.count:
            return []
        count = _Registrations.count
        unknown = [
            (name, param)
            for name, param in self.model.named_parameters()
            if self.dense.get(name) is not param
        ]
        self._dense_as_of = None if unknown else count
        return [name for name, param in unknown if param.grad is not None]

    def grad_tensors(self) -> list[Tensor]:
        """Every tensor holding a gradient of this step (for clipping by global norm)."""
        leaves: list[Tensor] = [p for p in self.dense.values() if p.grad is not None]
        leaves += [r.rows for r in self.tables.values() if r.rows.grad is not None]
        return leaves


def _ends_within(ids: list[np.ndarray], bounds: list[tuple[int, int]]) -> bool:
    """Whether each of ``ids`` (sorted) lies within its ``bounds``: by its ends."""
    return all(
        not part.size or (low <= part[0] and part[-1] <= high)
        for part, (low, high) in zip(ids, bounds, strict=True)
    )


def _no_rows(dim: int) -> tuple[Tensor, Tensor]:
    return torch.empty(0, dtype=torch.int64), torch.empty(0, dim)
