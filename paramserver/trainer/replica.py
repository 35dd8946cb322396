"""A trainer's working copy of the user's model, with embedding layers made remote.

Every ``nn.Embedding`` and ``nn.EmbeddingBag`` (any mode) is replaced by a
:class:`RemoteEmbedding` that looks ids up in the rows pulled for the current step: a leaf
tensor ``rows`` (requires grad) holding the unique ids the step touches, sorted. After backward,
``rows.grad`` is exactly the gradient of those rows, so a push carries only touched rows.

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

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from paramserver.embedding import DynamicEmbedding
from paramserver.errors import InvalidBatchError, ModelError
from paramserver.modelplan import Embedding, find_embeddings
from paramserver.protocol import BagBlock
from paramserver.trainer.lookups import (
    Recorded,
    RecordedLookups,
    Recorder,
    RecordingDone,
    StepLookups,
    unique_lookups,
)
from paramserver.types import Inputs, as_tuple


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


class MissingRows(Exception):
    """A lookup met ids whose rows were not pulled for this step."""

    def __init__(self, table: str, ids: Tensor):
        super().__init__(f"table {table}: {ids.numel()} ids not pulled")
        self.table = table
        self.ids = ids


class RemoteEmbedding(nn.Module):
    """Drop-in for an ``nn.Embedding``, ``nn.EmbeddingBag`` or ``DynamicEmbedding`` whose
    weight lives on servers. ``num_embeddings`` is None for a dynamic table (any id)."""

    def __init__(self, table: str, source: Embedding):
        super().__init__()
        self.table = table
        self.embedding_dim = source.embedding_dim
        self.num_embeddings: int | None = None
        self.padding_idx: int | None = None
        self.scale_grad_by_freq = False
        self.include_last_offset = False
        if isinstance(source, DynamicEmbedding):
            self.is_bag = source.mode is not None
            self.mode = source.mode or "sum"
        else:
            if source.max_norm is not None:
                raise ModelError(
                    f"table {table}: max_norm rewrites the weight inside forward, "
                    "which a sharded table cannot do; remove max_norm"
                )
            self.is_bag = isinstance(source, nn.EmbeddingBag)
            self.num_embeddings = source.num_embeddings
            self.padding_idx = source.padding_idx
            self.scale_grad_by_freq = source.scale_grad_by_freq
            self.mode = getattr(source, "mode", "mean")
            self.include_last_offset = getattr(source, "include_last_offset", False)
        self.ids = torch.empty(0, dtype=torch.int64)
        self.rows = torch.empty(0, self.embedding_dim)
        self.lookups: list[tuple[Tensor, Tensor]] = []  # see set_rows
        self.recorder: Recorder | None = None
        self.server_pooled = False
        self.pooled = torch.empty(0, self.embedding_dim)  # sums of this step's bags (a leaf)
        self.pooled_bags: BagBlock | None = None  # the bags those sums are of
        # Plain lookups (no bags, padding or scaling) may be made with the other tables' in one
        # autograd node, by the replica's StepLookups (set by the replica).
        self.joins_step_lookups = (
            not self.is_bag and self.padding_idx is None and not self.scale_grad_by_freq
        )
        self.step_lookups: StepLookups | None = None

    # Set for every step and record pass: plain attributes, so nn.Module.__setattr__'s search
    # for a parameter, buffer or submodule of the name (microseconds, per table) is skipped.
    _PER_STEP = frozenset({"ids", "rows", "lookups", "recorder", "pooled", "pooled_bags"})

    def __setattr__(self, name: str, value: Any) -> None:
        if name in RemoteEmbedding._PER_STEP:
            self.__dict__[name] = value
        else:
            super().__setattr__(name, value)

    def pool_on_servers(self) -> None:
        """Have the servers pool this table's bags (sum or mean): the trainer then moves one
        vector per bag instead of one per row."""
        if not self.is_bag or self.mode not in ("sum", "mean"):
            raise ModelError(
                f"table {self.table}: only sum and mean bags can be pooled on the servers"
            )
        if self.padding_idx is not None or self.include_last_offset or self.scale_grad_by_freq:
            raise ModelError(
                f"table {self.table}: server pooling supports no padding_idx, "
                "include_last_offset or scale_grad_by_freq"
            )
        self.server_pooled = True

    def bags_of(self, input: Tensor, offsets: Tensor | None, weights: Tensor | None) -> BagBlock:
        """Each id's bag, in the layout EmbeddingBag takes (2-D input, or 1-D with offsets)."""
        ids = input.reshape(-1).to(torch.int64)
        if input.dim() == 2:
            num_bags, length = input.shape
            bags = torch.arange(num_bags).repeat_interleave(length)
        else:
            assert offsets is not None, "EmbeddingBag with 1-D input needs offsets"
            num_bags = offsets.numel()
            bounds = torch.cat([offsets.to(torch.int64), torch.tensor([ids.numel()])])
            bags = torch.arange(num_bags).repeat_interleave(bounds.diff())
        flat_weights = None if weights is None else weights.reshape(-1).to(self.rows.dtype)
        return BagBlock(ids, bags, int(num_bags), flat_weights)

    def extra_repr(self) -> str:
        kind = f"EmbeddingBag(mode={self.mode})" if self.is_bag else "Embedding"
        rows = "dynamic" if self.num_embeddings is None else self.num_embeddings
        return f"table={self.table!r}, {kind}, {rows}x{self.embedding_dim}"

    def set_rows(self, ids: Tensor, rows: Tensor, lookups: RecordedLookups | None = None) -> None:
        """Use ``rows`` (one per sorted unique id in ``ids``) for lookups until the next call;
        ``lookups``, recorded for these very ids, spare the lookups it holds a search."""
        self.ids = ids
        self.rows = rows
        self.lookups = lookups.each if lookups is not None and lookups.ids is ids else []

    def forward(
        self, input: Tensor, offsets: Tensor | None = None, per_sample_weights: Tensor | None = None
    ) -> Tensor:
        if self.recorder is not None:
            self.check_range(input)
            bags = self.bags_of(input, offsets, per_sample_weights) if self.server_pooled else None
            self.recorder.add(self.table, input, bags)
            return torch.zeros(self._output_shape(input, offsets), dtype=self.rows.dtype)
        if self.server_pooled:
            bags = self.pooled_bags
            if bags is None or not torch.equal(input.reshape(-1).to(torch.int64), bags.ids):
                raise ModelError(
                    f"table {self.table} is pooled on the servers, but the forward looked up "
                    "other ids than its record pass (eval mode); the model's lookups must not "
                    "depend on the mode"
                )
            if self.mode == "mean":
                sizes = torch.bincount(bags.bags, minlength=bags.num_bags).clamp_(min=1)
                return self.pooled / sizes.unsqueeze(1).to(self.pooled.dtype)
            return self.pooled
        ids = input.to(torch.int64)
        recorded = self._recorded_lookup(ids.reshape(-1))
        if recorded is not None and self.joins_step_lookups and self.step_lookups is not None:
            rows = self.step_lookups.output(self.table, recorded)
            if rows is not None:
                return rows.view(*ids.shape, self.embedding_dim)
        local = self._local_ids(ids, recorded)
        padding = self._local_padding()
        if not self.is_bag and padding is None and not self.scale_grad_by_freq:
            # F.embedding's result and gradient, bitwise, for less: index_select's backward
            # (an index_add) costs about 60% of embedding's dense backward on CPU.
            rows = self.rows.index_select(0, local.reshape(-1))
            return rows.view(*local.shape, self.embedding_dim)
        if not self.is_bag:
            return F.embedding(
                local, self.rows, padding_idx=padding, scale_grad_by_freq=self.scale_grad_by_freq
            )
        return F.embedding_bag(
            local,
            self.rows,
            offsets,
            mode=self.mode,
            scale_grad_by_freq=self.scale_grad_by_freq,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
            padding_idx=padding,
        )

    def check_range(self, ids: Tensor) -> None:
        """Raise :class:`InvalidBatchError` unless every id is a row of this table."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise InvalidBatchError(
                f"table {self.table}: ids must be int64 or int32, got {ids.dtype}"
            )
        if self.num_embeddings is None:  # dynamic: every id is valid
            return
        if ids.numel() == 0:
            return
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.num_embeddings:
            bad = low if low < 0 else high
            raise InvalidBatchError(
                f"table {self.table}: id {bad} out of range [0, {self.num_embeddings})"
            )

    def _output_shape(self, input: Tensor, offsets: Tensor | None) -> tuple[int, ...]:
        if not self.is_bag:
            return (*input.shape, self.embedding_dim)
        if input.dim() == 2:
            return (input.shape[0], self.embedding_dim)
        assert offsets is not None, "EmbeddingBag with 1-D input needs offsets"
        bags = offsets.numel() - (1 if self.include_last_offset else 0)
        return (bags, self.embedding_dim)

    def _recorded_lookup(self, flat: Tensor) -> int | None:
        """Which of :attr:`lookups` is of exactly the ids ``flat`` (int64), if any."""
        for index, (recorded, _) in enumerate(self.lookups):
            if recorded.shape == flat.shape and torch.equal(recorded, flat):
                return index
        return None

    def _local_ids(self, ids: Tensor, recorded: int | None) -> Tensor:
        """The positions of ``ids`` (int64) among the pulled ids: those of the lookup
        ``recorded`` (see :meth:`_recorded_lookup`), else searched."""
        if recorded is not None:
            return self.lookups[recorded][1].view(ids.shape)
        if self.ids.numel() == 0:
            if ids.numel():
                raise MissingRows(self.table, torch.unique(ids))
            return ids
        ids = ids.contiguous()
        positions = torch.searchsorted(self.ids, ids).clamp_(max=self.ids.numel() - 1)
        found = self.ids[positions] == ids
        if not bool(found.all()):
            raise MissingRows(self.table, torch.unique(ids[~found]))
        return positions

    def _local_padding(self) -> int | None:
        if self.padding_idx is None or self.ids.numel() == 0:
            return None
        position = int(torch.searchsorted(self.ids, torch.tensor(self.padding_idx)))
        if position < self.ids.numel() and int(self.ids[position]) == self.padding_idx:
            return position
        return None


class Replica:
    """The trainer's model with remote tables, and the moves of one step: record ids, load
    pulled values, run forward, collect gradients."""

    def __init__(self, model: nn.Module, server_pooling: Sequence[str] = ()):
        embeddings = find_embeddings(model)
        remotes = {id(m): RemoteEmbedding(name, m) for name, m in embeddings.items()}
        if id(model) in remotes:
            model = remotes[id(model)]
        for module in model.modules():
            for child_name, child in list(module._modules.items()):
                if child is not None and id(child) in remotes:
                    module._modules[child_name] = remotes[id(child)]
        tied = {id(m.weight) for m in embeddings.values()} & {id(p) for p in model.parameters()}
        if tied:
            raise ModelError(
                "an embedding weight is shared with another module (tied weights); "
                "a sharded table cannot also be a dense parameter"
            )
        self.model = model
        self.tables = {r.table: r for r in remotes.values()}
        for name in server_pooling:
            self.tables[name].pool_on_servers()
        self.dense = dict(model.named_parameters())
        self._modules = list(model.modules())
        self._lookups_per_forward: dict[str, int] | None = None
        self._forward = model.forward  # the model's own, whatever route_forward installs
        self._recording_pass = False
        self._step_lookups = StepLookups(self.tables)
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
        for call in calls:
            recorder = Recorder(self._lookups_per_forward)
            with self._recording(recorder), torch.no_grad(), suppress(RecordingDone):
                self.model(*call.args, **call.kwargs)
            if self._lookups_per_forward is None:
                self._lookups_per_forward = {t: len(v) for t, v in recorder.ids.items()}
            if recorder.bags and len(calls) > 1:
                raise ModelError("server-pooled tables take one batch per step (accumulate 1)")
            bags.update(recorder.bags)
            for table, each in recorder.ids.items():
                if table not in recorder.bags:
                    recorded.setdefault(table, []).extend(each)
        unique, lookups = unique_lookups(recorded)
        return Recorded(unique, bags, lookups)

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
        with torch.no_grad():
            for name, value in dense.items():
                self.dense[name].copy_(value)
        for param in self.dense.values():
            param.grad = None
        self._load_rows(rows, lookups or {})

    def _load_rows(
        self, rows: dict[str, tuple[Tensor, Tensor]], lookups: dict[str, RecordedLookups]
    ) -> None:
        for name, remote in self.tables.items():
            ids, values = rows.get(
                name, (torch.empty(0, dtype=torch.int64), torch.empty(0, remote.embedding_dim))
            )
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
        while True:
            try:
                with self._step_lookups.forward():
                    return self._forward(*call.args, **call.kwargs)
            except MissingRows as missing:
                ids = missing.ids
                self.tables[missing.table].check_range(ids)
                self.add_rows(missing.table, *fetch({missing.table: ids})[missing.table])

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
        return bool(self.grad_tensors()) or bool(self.pooled_gradients())

    def unknown_parameters_with_grad(self) -> list[str]:
        """Parameters of the model with a gradient that are not the ones it was built with
        (added or replaced since): the servers do not know them."""
        return [
            name
            for name, param in self.model.named_parameters()
            if param.grad is not None and self.dense.get(name) is not param
        ]

    def grad_tensors(self) -> list[Tensor]:
        """Every tensor holding a gradient of this step (for clipping by global norm)."""
        leaves: list[Tensor] = [p for p in self.dense.values() if p.grad is not None]
        leaves += [r.rows for r in self.tables.values() if r.rows.grad is not None]
        return leaves
