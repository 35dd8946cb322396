"""The trainer's side of a sharded table: every lookup of it, however the model makes it.

A table is one weight of an ``nn.Embedding``, ``nn.EmbeddingBag`` or ``DynamicEmbedding``; on a
trainer it becomes one :class:`RemoteEmbedding`, holding the rows pulled for the current step (a
leaf ``rows`` that requires grad, one row per sorted unique id the step touches). A model reaches
those rows in three ways, each a :meth:`RemoteEmbedding.lookup` with its own
:class:`LookupOptions`:

- the layer itself (``self.item(ids)``), which the replica replaces by the table;
- another layer holding the same weight (``self.history.weight = self.item.weight``: one item
  table for a history bag and the target item), replaced by a :class:`TableView`;
- the weight used directly, ``F.embedding(ids, self.item.weight)`` or
  ``F.embedding_bag(ids, self.item.weight, offsets)``: the layer's ``weight`` (and any module
  attribute that held it) reads as a :class:`RemoteWeight`, a placeholder of the table's shape
  whose only uses are these two functions and questions about its shape. Any other use (a
  matrix product with it, an L2 term over it) is refused naming the table: the table is on the
  servers and a trainer never holds it whole.

A record pass (see :mod:`paramserver.trainer.replica`) runs every lookup with a recorder set:
it records the ids and returns zeros of the output's shape.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from paramserver.embedding import DynamicEmbedding
from paramserver.errors import InvalidBatchError, ModelError
from paramserver.modelplan import SERVED, Embedding, find_embeddings, table_size
from paramserver.trainer import bags as pooling
from paramserver.trainer.lookups import RecordedLookups, Recorder, StepLookups
from paramserver.wire.messages import BagBlock


def remote_tables(model: nn.Module) -> tuple[nn.Module, dict[str, RemoteEmbedding]]:
    """``model`` with its tables made remote, and the tables by name: each table's first
    layer becomes its :class:`RemoteEmbedding`, other layers sharing the weight its
    :class:`TableView`, and a module attribute holding the weight its :class:`RemoteWeight`.

    Refuses (:class:`~paramserver.errors.ModelError`) a table whose weight is also the
    parameter of one of torch's own layers that is no embedding (an ``nn.Linear`` tied to it,
    say): that layer would read the table whole."""
    first_layers = find_embeddings(model)
    remotes = {id(m.weight): RemoteEmbedding(name, m) for name, m in first_layers.items()}
    firsts = {id(m) for m in first_layers.values()}
    modules = list(model.named_modules())
    replaced: dict[int, nn.Module] = {}
    for _, module in modules:
        if isinstance(module, SERVED) and id(module) not in replaced:
            remote = remotes[id(module.weight)]
            replaced[id(module)] = remote if id(module) in firsts else TableView(remote, module)
    if id(model) in replaced:  # the model is one table
        return replaced[id(model)], {r.table: r for r in remotes.values()}
    for path, module in modules:
        for child_name, child in list(module._modules.items()):
            if child is not None and id(child) in replaced:
                module._modules[child_name] = replaced[id(child)]
        if isinstance(module, SERVED):
            continue
        for key, value in list(module._parameters.items()):
            if value is not None and id(value) in remotes:
                _hold_weight(module, path, key, remotes[id(value)])
    return model, {r.table: r for r in remotes.values()}


def _hold_weight(module: nn.Module, path: str, key: str, remote: RemoteEmbedding) -> None:
    """Have ``module.key``, a table's weight, read as the table's :class:`RemoteWeight`."""
    kind = type(module)
    if kind.__module__.startswith("torch."):
        raise ModelError(
            f"table {remote.table}: its weight is also the {key} of {path or 'the model'} "
            f"({kind.__name__}), which would read the table whole (tied weights); a sharded "
            "table is read only by lookups: untie them, or make the tied weight a plain "
            "nn.Parameter of that layer (it is then dense, not sharded)"
        )
    del module._parameters[key]
    module.__dict__[key] = remote.weight


class MissingRows(Exception):
    """A lookup met ids whose rows were not pulled for this step."""

    def __init__(self, table: str, ids: Tensor):
        super().__init__(f"table {table}: {ids.numel()} ids not pulled")
        self.table = table
        self.ids = ids


@dataclass(frozen=True)
class LookupOptions:
    """How one lookup reads a table: as an ``Embedding`` (``bag_mode`` None) or as an
    ``EmbeddingBag`` of ``bag_mode``, with the layer's other options."""

    bag_mode: str | None = None
    padding_idx: int | None = None
    scale_grad_by_freq: bool = False
    include_last_offset: bool = False
    sparse: bool = False  # a bag's gradient as torch's sparse one (paramserver.trainer.bags)

    @property
    def plain(self) -> bool:
        """One row per id, nothing else: such lookups may be made together (StepLookups)."""
        return self.bag_mode is None and self.padding_idx is None and not self.scale_grad_by_freq

    @classmethod
    def of_layer(cls, table: str, layer: Embedding) -> LookupOptions:
        """The lookups ``layer``'s own forward makes."""
        if isinstance(layer, DynamicEmbedding):
            return cls(bag_mode=layer.mode)
        if layer.max_norm is not None:
            raise _max_norm_refused(table)
        padding = None if layer.padding_idx is None else int(layer.padding_idx)
        if isinstance(layer, nn.EmbeddingBag):
            return cls(
                layer.mode, padding, layer.scale_grad_by_freq, layer.include_last_offset,
                layer.sparse,
            )  # fmt: skip
        return cls(None, padding, layer.scale_grad_by_freq)


def _max_norm_refused(table: str) -> ModelError:
    return ModelError(
        f"table {table}: max_norm renormalizes the weight's rows inside forward, which a "
        "sharded table cannot do (the rows are on the servers); remove max_norm, or clip the "
        "looked-up vectors in forward (torch.renorm on the output)"
    )


class RemoteEmbedding(nn.Module):
    """Drop-in for an ``nn.Embedding``, ``nn.EmbeddingBag`` or ``DynamicEmbedding`` whose
    weight lives on servers. ``num_embeddings`` is None for a dynamic table (any id)."""

    def __init__(self, table: str, source: Embedding):
        super().__init__()
        self.table = table
        self.embedding_dim = table_size(source, table, "embedding_dim")
        self.num_embeddings: int | None = None
        if not isinstance(source, DynamicEmbedding):
            self.num_embeddings = table_size(source, table, "num_embeddings")
        self.options = LookupOptions.of_layer(table, source)
        self.ids = torch.empty(0, dtype=torch.int64)
        self.rows = torch.empty(0, self.embedding_dim)
        self.lookups: list[tuple[Tensor, Tensor]] = []  # see set_rows
        self.recorder: Recorder | None = None
        self.server_pooled = False
        self.pooled = torch.empty(0, self.embedding_dim)  # sums of this step's bags (a leaf)
        self.pooled_bags: BagBlock | None = None  # the bags those sums are of
        self.views = 0  # other layers reading this table (TableView)
        self.unmatched = 0  # training lookups of ids no record (or derivation) gave
        # Plain lookups may be made with the other tables' in one autograd node, by the
        # replica's StepLookups (set by the replica): where every layer reading it makes them.
        self.joins_step_lookups = self.options.plain
        self.step_lookups: StepLookups | None = None
        rows = 0 if self.num_embeddings is None else self.num_embeddings
        shape = (rows, self.embedding_dim)
        self.__dict__["weight"] = RemoteWeight.of(self, shape, source.weight.dtype)

    # Set for every step and record pass: plain attributes, so nn.Module.__setattr__'s search
    # for a parameter, buffer or submodule of the name (microseconds, per table) is skipped.
    _PER_STEP = frozenset(
        {"ids", "rows", "lookups", "recorder", "pooled", "pooled_bags", "unmatched"}
    )

    def __setattr__(self, name: str, value: Any) -> None:
        if name in RemoteEmbedding._PER_STEP:
            self.__dict__[name] = value
        else:
            super().__setattr__(name, value)

    def pool_on_servers(self) -> None:
        """Have the servers pool this table's bags (sum or mean): the trainer then moves one
        vector per bag instead of one per row."""
        options = self.options
        if options.bag_mode not in ("sum", "mean"):
            raise ModelError(
                f"table {self.table}: only sum and mean bags can be pooled on the servers"
            )
        if any(
            (
                options.padding_idx is not None,
                options.include_last_offset,
                options.scale_grad_by_freq,
            )
        ):
            raise ModelError(
                f"table {self.table}: server pooling supports no padding_idx, "
                "include_last_offset or scale_grad_by_freq"
            )
        if self.views:
            raise ModelError(
                f"table {self.table}: server pooling needs the table read by its own layer "
                "alone, but other layers share its weight"
            )
        self.server_pooled = True

    def add_view(self, options: LookupOptions) -> None:
        """Another layer reads this table with ``options``."""
        self.views += 1
        self.joins_step_lookups = self.joins_step_lookups and options.plain

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
        mode = self.options.bag_mode
        kind = f"EmbeddingBag(mode={mode})" if mode is not None else "Embedding"
        rows = "dynamic" if self.num_embeddings is None else self.num_embeddings
        return f"table={self.table!r}, {kind}, {rows}x{self.embedding_dim}"

    def set_rows(self, ids: Tensor, rows: Tensor, lookups: RecordedLookups | None = None) -> None:
        """Use ``rows`` (one per sorted unique id in ``ids``) for lookups until the next call;
        ``lookups``, recorded for these very ids, spare the lookups it holds a search."""
        attributes = self.__dict__  # plain attributes (see _PER_STEP), set without a call each
        attributes["ids"], attributes["rows"] = ids, rows
        attributes["lookups"] = lookups.each if lookups is not None and lookups.ids is ids else []

    def forward(
        self, input: Tensor, offsets: Tensor | None = None, per_sample_weights: Tensor | None = None
    ) -> Tensor:
        return self.lookup(input, offsets, per_sample_weights, self.options)

    def lookup(
        self,
        input: Tensor,
        offsets: Tensor | None,
        per_sample_weights: Tensor | None,
        options: LookupOptions,
    ) -> Tensor:
        """The rows of ``input``'s ids, as a lookup with ``options`` gives them."""
        # Bags the trainer pools that may be pooled ahead (StepLookups.pooled): the offsets.
        ahead = None
        if not self.server_pooled and _pools_ahead(offsets, options, per_sample_weights):
            ahead = offsets
        if self.recorder is not None:
            self.check_range(input)
            bags = None
            if self.server_pooled:
                self._check_pooled(options)
                bags = self.bags_of(input, offsets, per_sample_weights)
            pooling_of = None if ahead is None else (ahead, options)
            self.recorder.add(self.table, input, bags, pooling_of)
            shape = self._output_shape(input, offsets, options)
            return torch.zeros(shape, dtype=self.rows.dtype)
        if self.server_pooled:
            return self._pooled_output(input, options)
        if ahead is not None and self.step_lookups is not None:
            pooled = self.step_lookups.pooled(self.table, input, ahead, options)
            if pooled is not None:
                return pooled
        ids = input.to(torch.int64)
        recorded = self.recorded_lookup(ids.reshape(-1))
        if recorded is None:
            self.unmatched += 1
        plain = options.plain
        if recorded is not None and plain and self.step_lookups is not None:
            rows = self.step_lookups.output(self.table, recorded)
            if rows is not None:
                return rows.view(*ids.shape, self.embedding_dim)
        local = self._local_ids(ids, recorded)
        if plain:
            # F.embedding's result and gradient, bitwise, for less: index_select's backward
            # (an index_add) costs about 60% of embedding's dense backward on CPU.
            rows = self.rows.index_select(0, local.reshape(-1))
            return rows.view(*local.shape, self.embedding_dim)
        return self._layer_lookup(local, offsets, per_sample_weights, options)

    def _layer_lookup(
        self,
        local: Tensor,
        offsets: Tensor | None,
        per_sample_weights: Tensor | None,
        options: LookupOptions,
    ) -> Tensor:
        """A lookup that is not plain, of the pulled rows at positions ``local``."""
        padding = self.local_padding(options.padding_idx)
        if options.bag_mode is None:
            return F.embedding(
                local, self.rows, padding_idx=padding, scale_grad_by_freq=options.scale_grad_by_freq
            )
        pooled = self._pool(local, offsets, per_sample_weights, options, padding)
        if pooled is not None:
            return pooled
        return F.embedding_bag(
            local,
            pooling.DenseGradient.of(self.rows) if options.sparse else self.rows,
            offsets,
            mode=options.bag_mode,
            scale_grad_by_freq=options.scale_grad_by_freq,
            per_sample_weights=per_sample_weights,
            include_last_offset=options.include_last_offset,
            padding_idx=padding,
            sparse=options.sparse,
        )

    def _pool(
        self,
        local: Tensor,
        offsets: Tensor | None,
        weights: Tensor | None,
        options: LookupOptions,
        padding: int | None,
    ) -> Tensor | None:
        """A bag lookup of the pulled rows by the compiled loops, joining this forward's
        other pooled lookups (:mod:`paramserver.trainer.bags`); None: torch's to make."""
        mode = options.bag_mode
        if mode is None or options.scale_grad_by_freq or not pooling.takes(self.rows, weights):
            return None
        bags = pooling.Bags.of(
            local, offsets, weights, mode, padding, options.include_last_offset, options.sparse
        )
        if bags is None:
            return None
        node = None if self.step_lookups is None else self.step_lookups.bag_node(self.rows)
        return pooling.pooled_lookup(self.rows, bags, weights, node)

    def _check_pooled(self, options: LookupOptions) -> None:
        if options != self.options:
            raise ModelError(
                f"table {self.table} is pooled on the servers, so only its own layer may look "
                "it up (not F.embedding or F.embedding_bag on its weight)"
            )

    def _pooled_output(self, input: Tensor, options: LookupOptions) -> Tensor:
        self._check_pooled(options)
        bags = self.pooled_bags
        if bags is None or not torch.equal(input.reshape(-1).to(torch.int64), bags.ids):
            raise ModelError(
                f"table {self.table} is pooled on the servers, but the forward looked up "
                "other ids than its record pass (eval mode); the model's lookups must not "
                "depend on the mode"
            )
        if options.bag_mode == "mean":
            sizes = torch.bincount(bags.bags, minlength=bags.num_bags).clamp_(min=1)
            return self.pooled / sizes.unsqueeze(1).to(self.pooled.dtype)
        return self.pooled

    def check_range(self, ids: Tensor, ascending: bool = False) -> None:
        """Raise :class:`InvalidBatchError` unless every id is a row of this table
        (``ascending``: ``ids`` are sorted, so their ends are their least and greatest)."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise InvalidBatchError(
                f"table {self.table}: ids must be int64 or int32, got {ids.dtype}"
            )
        if self.num_embeddings is None:  # dynamic: every id is valid
            return
        if ids.numel() == 0:
            return
        if ascending:  # numpy reads the ends for a fraction of torch's two indexings
            ends = ids.numpy()
            low, high = int(ends[0]), int(ends[-1])
        else:
            low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.num_embeddings:
            bad = low if low < 0 else high
            raise InvalidBatchError(
                f"table {self.table}: id {bad} out of range [0, {self.num_embeddings})"
            )

    def _output_shape(
        self, input: Tensor, offsets: Tensor | None, options: LookupOptions
    ) -> tuple[int, ...]:
        if options.bag_mode is None:
            return (*input.shape, self.embedding_dim)
        if input.dim() == 2:
            return (input.shape[0], self.embedding_dim)
        if offsets is None:
            raise ModelError(f"table {self.table}: a bag lookup of 1-D ids needs offsets")
        bags = offsets.numel() - (1 if options.include_last_offset else 0)
        return (bags, self.embedding_dim)

    def recorded_lookup(self, flat: Tensor) -> int | None:
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

    def local_padding(self, padding_idx: int | None) -> int | None:
        if padding_idx is None or self.ids.numel() == 0:
            return None
        position = int(torch.searchsorted(self.ids, torch.tensor(padding_idx)))
        if position < self.ids.numel() and int(self.ids[position]) == padding_idx:
            return position
        return None


class TableView(nn.Module):
    """Another layer holding a table's weight (a shared or tied embedding): it reads the
    table with its own options (an ``EmbeddingBag`` over an ``Embedding``'s weight, say)."""

    def __init__(self, remote: RemoteEmbedding, layer: Embedding):
        super().__init__()
        self.options = LookupOptions.of_layer(remote.table, layer)
        self.embedding_dim = remote.embedding_dim
        self.__dict__["remote"] = remote  # not a submodule: the table has one place
        remote.add_view(self.options)

    @property
    def weight(self) -> RemoteWeight:
        return self.__dict__["remote"].weight

    def extra_repr(self) -> str:
        return f"view of table {self.__dict__['remote'].table!r}, {self.options}"

    def forward(
        self, input: Tensor, offsets: Tensor | None = None, per_sample_weights: Tensor | None = None
    ) -> Tensor:
        remote: RemoteEmbedding = self.__dict__["remote"]
        return remote.lookup(input, offsets, per_sample_weights, self.options)


# Questions about a tensor that a RemoteWeight answers: its shape, not its values.
_SHAPE_METHODS = frozenset({"size", "dim", "numel", "__repr__", "__format__", "element_size"})
_SHAPE_PROPERTIES = frozenset(
    {"shape", "dtype", "device", "ndim", "requires_grad", "is_meta", "layout", "is_leaf", "grad"}
)
_LOOKUPS = {
    F.embedding: (inspect.signature(F.embedding), None),
    F.embedding_bag: (inspect.signature(F.embedding_bag), "mean"),
}


class RemoteWeight(Tensor):
    """What a sharded table's weight reads as on a trainer: the table's shape and dtype on the
    meta device, looked up through ``F.embedding`` and ``F.embedding_bag`` (see the module
    docstring); every other use raises :class:`~paramserver.errors.ModelError`."""

    remote: RemoteEmbedding

    @staticmethod
    def of(remote: RemoteEmbedding, shape: tuple[int, int], dtype: torch.dtype) -> RemoteWeight:
        placeholder = torch.empty(shape, dtype=dtype, device="meta")
        weight = Tensor._make_subclass(RemoteWeight, placeholder, False)
        weight.__dict__["remote"] = remote
        return weight

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        remote = self.__dict__["remote"]
        return f"RemoteWeight(table={remote.table!r}, shape={tuple(self.shape)})"

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Any = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _LOOKUPS:
            return _functional_lookup(func, args, kwargs)
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: its descriptor has the name
            name = getattr(getattr(func, "__self__", None), "__name__", "")
            allowed = name in _SHAPE_PROPERTIES
        else:
            allowed = name in _SHAPE_METHODS
        if allowed:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        tables = sorted({a.__dict__["remote"].table for a in _weights_in(args, kwargs)})
        raise ModelError(
            f"table {', '.join(tables)}: its weight is used by {name or func}, but a sharded "
            "table's rows live on the servers and a trainer never holds it whole; read it "
            "through its layer, F.embedding or F.embedding_bag (regularize looked-up rows, or "
            "set weight_decay in the table's optimizer)"
        )


def _weights_in(args: Any, kwargs: dict) -> list[RemoteWeight]:
    found = [*args, *kwargs.values()]
    nested = [x for a in found if isinstance(a, list | tuple) for x in a]
    return [a for a in [*found, *nested] if isinstance(a, RemoteWeight)]


def _functional_lookup(func: Any, args: Any, kwargs: dict) -> Tensor:
    """``F.embedding`` or ``F.embedding_bag`` called with a table's weight: the table's
    lookup with the call's options."""
    signature, default_mode = _LOOKUPS[func]
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    call = bound.arguments
    weight = call["weight"]
    if not isinstance(weight, RemoteWeight) or isinstance(call["input"], RemoteWeight):
        tables = sorted({w.__dict__["remote"].table for w in _weights_in(args, kwargs)})
        raise ModelError(
            f"table {', '.join(tables)}: its weight must be the weight argument of {func.__name__}"
        )
    remote: RemoteEmbedding = weight.__dict__["remote"]
    if call["max_norm"] is not None:
        raise _max_norm_refused(remote.table)
    padding = call["padding_idx"]
    if padding is not None:
        padding = int(padding)
        if padding < 0:
            if remote.num_embeddings is None:
                raise ModelError(f"table {remote.table}: a dynamic table has no negative ids")
            padding += remote.num_embeddings
    bag_mode = call.get("mode", default_mode)
    options = LookupOptions(
        bag_mode=bag_mode,
        padding_idx=padding,
        scale_grad_by_freq=bool(call["scale_grad_by_freq"]),
        include_last_offset=bool(call.get("include_last_offset", False)),
        sparse=bag_mode is not None and bool(call["sparse"]),  # a plain lookup's: the same
    )
    return remote.lookup(
        call["input"], call.get("offsets"), call.get("per_sample_weights"), options
    )


def _pools_ahead(offsets: Tensor | None, options: LookupOptions, weights: Tensor | None) -> bool:
    """Whether a lookup with these offsets, options and weights may be pooled ahead with the
    forward's others (:meth:`StepLookups.pooled`): sum or mean bags given by offsets,
    unweighted, not scaled by frequency."""
    return (
        offsets is not None
        and options.bag_mode in ("sum", "mean")
        and not options.scale_grad_by_freq
        and weights is None
    )
