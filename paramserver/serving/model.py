"""The model a serving process answers from, one version at a time.

Serving holds every table and dense value of the model in one
:class:`~paramserver.store.store.Store` (one "server" of a plan of one), whatever the number of
training servers whose logs it follows. The user's model is bound to that store: each fixed
table's weight *is* the store's rows (a view, so the model's own forward reads them, bags,
shared weights and all), each dense parameter and persistent buffer *is* the store's value,
and each ``DynamicEmbedding`` reads the rows of the ids it is called with from the store just before
it runs (an id without a row reads as the table's default vector: serving never creates
rows). Nothing of a version is copied into the model: applying one writes the store in place.

A model larger than the serving machine's memory: with ``mmap_dir`` the fixed tables' rows
(most of a recommendation model) live in files there, mapped shared, so the system keeps the
rows requests read in memory and writes back and drops the others under pressure (memory
counted as ``RssFile``, reclaimable, rather than ``RssAnon``). A dynamic table's rows and the
dense values stay in memory. (benchmarks/bench_serve_memory.py measures both.)

One lock orders the two: a version is applied whole under it, and each request (a lookup, a
prediction) runs whole under it, so no request sees part of a version.

The base a serving process starts from is a checkpoint (each training server's part records
the change of its store it covers, where that server's log is followed from), or the job's
initial model (the model ``model_fn`` builds under the job's seed: every log from its start).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from paramserver.changelog.segment import Segment
from paramserver.checkpoint.store import Checkpoint
from paramserver.embedding import DynamicEmbedding
from paramserver.errors import ChangeLogError, CheckpointError, InvalidBatchError
from paramserver.modelplan import (
    build_model,
    find_embeddings,
    plan_of,
    replace_parameter,
    table_aliases,
)
from paramserver.optimconfig import OptimizerConfig
from paramserver.sharding import ShardPlan
from paramserver.store.growth import file_backed
from paramserver.store.snapshot import model_signature, restore_store
from paramserver.store.store import Store
from paramserver.store.table import Reading
from paramserver.types import ModelFn

_NO_UPDATES = OptimizerConfig(name="sgd", lr=1.0)  # serving applies no gradient: no state


@dataclass
class Version:
    """What a served model holds: where it stands in each training server's chain (the
    sequence of the last segment applied, or of the last one its base covers whole), that
    segment's last step, and the store change it covers."""

    segments: dict[int, int] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    changes: dict[int, int] = field(default_factory=dict)
    applied_at: float = 0.0  # time.time() of the newest segment's publication it holds

    @property
    def number(self) -> int:
        """The served version's number: the sum of its places in the chains. Sequences only
        rise along a chain (a resumed job's too) and each version moves at least one, so the
        number rises with every version, and a serving process restarted on the same log
        answers numbers a client can compare with the earlier process's (it answers once it
        has caught up with the log, which only grows). 0: the job's initial model."""
        return sum(self.segments.values())


class ServedModel:
    """The user's model over a store of all its tables (see the module doc)."""

    def __init__(
        self, model_fn: ModelFn, seed: int = 0, mmap_dir: str | os.PathLike[str] | None = None
    ):
        """``mmap_dir``: hold the fixed tables' rows in files there, mapped (see the module
        doc); by default in memory."""
        built = build_model(model_fn, seed)
        self.model = built.model.eval()
        self.plan = plan_of(self.model, 1)
        self.aliases = table_aliases(self.model)
        parameters = dict(self.model.named_parameters())
        dense = {name: parameters[name].detach() for name in self.plan.dense}
        buffers = dict(self.model.named_buffers())
        dense.update({name: buffers[name] for name in self.plan.buffers})
        rules = dict.fromkeys(self.plan.tables, _NO_UPDATES)
        storage = None if mmap_dir is None else file_backed(mmap_dir)
        self.store = Store(0, self.plan, dense, built.inits, _NO_UPDATES, rules,
                           fixed_storage=storage)  # fmt: skip
        self.lock = threading.Lock()
        self.version = Version()
        self._routing: dict[int, ShardPlan] = {}  # a training job's, by its server count
        self._bind(parameters)

    def _bind(self, parameters: Mapping[str, nn.Parameter]) -> None:
        """Make the model read the store (see the module doc)."""
        for name, slot in self.store.dense.items():
            if name in self.store.buffers:  # the model reads the store's tensor itself
                holder, _, key = name.rpartition(".")
                self.model.get_submodule(holder)._buffers[key] = slot.value
                continue
            parameters[name].requires_grad_(False)
            parameters[name].data = slot.value
        for name, module in find_embeddings(self.model).items():
            module.weight.requires_grad_(False)
            if isinstance(module, DynamicEmbedding):
                module.register_forward_pre_hook(functools.partial(self._load_rows, name))
            else:  # a fixed table's weight is on the meta device: replaced, shared or not
                rows = nn.Parameter(self.store.tables[name].weight, requires_grad=False)
                replace_parameter(self.model, module.weight, rows)

    def _load_rows(self, name: str, module: DynamicEmbedding, args: tuple[Any, ...]) -> None:
        ids = torch.unique(args[0].to(torch.int64))
        module.ids, module.weight.data = ids, self.store.read({name: ids}, Reading()).values[name]

    # ---- the base ----

    def load_checkpoint(self, found: Checkpoint) -> None:
        """Take the model of checkpoint ``found`` (saved by any number of servers) and the
        store change each training server's part covers."""
        names = sorted(n for n in found.part_names if n.startswith("server-"))
        signature = model_signature(self.store)
        covered: dict[int, int] = {}

        def parts() -> Any:
            for name in names:
                tensors, meta = found.read_part(name)
                if meta.get("signature") != signature:
                    raise CheckpointError(
                        f"{found.directory}: {name} was saved from a different model than the "
                        f"one served (other parameters, tables or shapes)"
                    )
                covered[int(meta["server"])] = int(meta.get("sequence", 0))
                yield tensors, meta

        with self.lock:
            restore_store(self.store, parts())
            self.version = Version(changes=covered)

    def load_state(self, state: Mapping[str, Tensor], where: str) -> None:
        """Take a plain state_dict's values (``paramserver export``'s: a dynamic table's as
        ``NAME.ids`` and ``NAME.weight``); every dense parameter and table must be there with
        its shape (CheckpointError naming ``where`` and what is missing or wrong)."""
        with self.lock:
            for name, slot in self.store.dense.items():
                value = self._entry(state, name, where, slot.value.shape)
                self.store.set_dense(name, value.to(slot.value.dtype), {}, slot.version)
            for name, spec in self.plan.tables.items():
                if spec.dynamic is None:
                    weight = self._entry(state, name, where, (spec.num_rows, spec.dim))
                    ids = torch.arange(spec.num_rows)
                else:
                    ids = state.get(name.removesuffix("weight") + "ids", torch.empty(0))
                    weight = self._entry(state, name, where, (ids.numel(), spec.dim))
                if ids.numel():
                    self.store.set_rows(name, {"ids": ids, "value": weight.to(spec.dtype)})

    @staticmethod
    def _entry(state: Mapping[str, Tensor], name: str, where: str, shape: Any) -> Tensor:
        value = state.get(name)
        if not isinstance(value, Tensor) or tuple(value.shape) != tuple(shape):
            got = tuple(value.shape) if isinstance(value, Tensor) else "nothing"
            raise CheckpointError(f"{where}: {name} must be of shape {tuple(shape)}, has {got}")
        return value

    # ---- versions ----

    def apply(self, segments: Sequence[Segment], published_at: float = 0.0) -> None:
        """Apply ``segments`` (each the next of its server's chain) as one version: checked
        whole first (tables, widths, ids), so a bad one changes nothing (ChangeLogError)."""
        for segment in segments:
            self.check(segment)
        with self.lock:
            for segment in segments:
                self._write(segment)
            version = self.version
            self.version = Version(
                {**version.segments, **{s.server: s.sequence for s in segments}},
                {**version.steps, **{s.server: s.last_step for s in segments}},
                {**version.changes, **{s.server: s.changes for s in segments}},
                max(version.applied_at, published_at),
            )

    def place_base(self, server: int, sequence: int, step: int) -> None:
        """Say that the base holds server ``server``'s chain up to segment ``sequence``
        (whole; ``step`` its last step): the version's place in that chain until a segment of
        it is applied. The model is unchanged."""
        with self.lock:
            version = self.version
            self.version = Version(
                {**version.segments, server: sequence}, {**version.steps, server: step},
                dict(version.changes), version.applied_at,
            )  # fmt: skip

    def check(self, segment: Segment) -> None:
        """Whether ``segment`` fits the served model (its tables, widths, ids and dense
        shapes); ChangeLogError where not."""
        for name, changes in segment.tables.items():
            table = self.store.tables.get(name)
            where = f"segment {segment.sequence} of server {segment.server}: table {name!r}"
            if table is None:
                raise ChangeLogError(f"{where}: the served model has no such table")
            if changes.ids.numel() and changes.values.shape[1] != table.spec.dim:
                raise ChangeLogError(f"{where}: rows of width {changes.values.shape[1]}, "
                                     f"not {table.spec.dim}")  # fmt: skip
            everything = torch.cat([changes.ids, changes.removed])
            if table.spec.dynamic is None and everything.numel() and (
                int(everything.min()) < 0 or int(everything.max()) >= table.spec.num_rows
                or changes.removed.numel()
            ):  # fmt: skip
                raise ChangeLogError(f"{where}: ids outside its rows, or a fixed row removed")
        for name, value in segment.dense.items():
            slot = self.store.dense.get(name)
            if slot is None or slot.value.shape != value.shape:
                raise ChangeLogError(
                    f"segment {segment.sequence} of server {segment.server}: dense parameter "
                    f"{name!r} is not one of the served model's, of that shape"
                )

    def _write(self, segment: Segment) -> None:
        for name, changes in segment.tables.items():
            dtype = self.store.tables[name].spec.dtype
            if segment.full and self.plan.tables[name].dynamic is not None:
                self._delete_unlisted(segment, name, changes.ids)
            if changes.ids.numel():
                rows = {"ids": changes.ids, "value": changes.values.to(dtype)}
                self.store.set_rows(name, rows)
            if changes.removed.numel():
                self.store.delete_ids(name, changes.removed)
        for name, value in segment.dense.items():
            slot = self.store.dense[name]
            self.store.set_dense(name, value.to(slot.value.dtype), {}, slot.version)

    def _delete_unlisted(self, segment: Segment, table: str, listed: Tensor) -> None:
        """A full segment holds every row its server has: delete the served ids of ``table``
        that server owns (by the job's routing over ``segment.servers``) that it lacks."""
        held = self.store.held_ids(table)
        routing = self._routing.get(segment.servers)
        if routing is None:
            tables = list(self.plan.tables.values())
            routing = self._routing[segment.servers] = ShardPlan([], tables, segment.servers)
        owned = held[routing.server_of_rows(table, held) == segment.server]
        gone = owned[~torch.isin(owned, listed)]
        if gone.numel():
            self.store.delete_ids(table, gone)

    # ---- requests ----

    def lookup(self, table: str, ids: Tensor) -> tuple[Tensor, Version]:
        """The rows of ``ids`` (int64, any shape) of ``table`` (any of its names): the
        table's default vector for a dynamic table's id without a row; with the version
        they are of."""
        name = self.aliases.get(table, table)
        spec = self.plan.tables.get(name)
        if spec is None:
            raise InvalidBatchError(
                f"no table {table!r}; the tables are {sorted(self.plan.tables)}"
            )
        if ids.dtype != torch.int64:
            raise InvalidBatchError(f"table {table!r}: ids must be int64, got {ids.dtype}")
        flat = ids.reshape(-1)
        if spec.dynamic is None and flat.numel() and (
            int(flat.min()) < 0 or int(flat.max()) >= spec.num_rows
        ):  # fmt: skip
            raise InvalidBatchError(
                f"table {table!r}: ids must be in 0..{spec.num_rows - 1}, got "
                f"{int(flat.min())}..{int(flat.max())}"
            )
        unique, inverse = torch.unique(flat, return_inverse=True)
        with self.lock:
            rows = self.store.read({name: unique}, Reading()).values[name]
            version = self.version
        return rows[inverse].reshape(*ids.shape, spec.dim), version

    @torch.no_grad()
    def predict(
        self, inputs: Sequence[Tensor], names: Sequence[str] | None = None
    ) -> tuple[Any, Version]:
        """The model's forward on ``inputs`` (its tensor arguments, in order, called
        ``names``), and the version it read. Where the forward fails on an id outside a fixed
        table's rows: InvalidBatchError naming the input that holds it, the table and its
        rows (found by running the forward again, each lookup checked before it runs: the
        forward's own path costs nothing more)."""
        with self.lock:
            try:
                return self.model(*inputs), self.version
            except (IndexError, RuntimeError) as error:
                checks = _LookupChecks(self._fixed_weights(), inputs, names)
                try:
                    with checks:
                        self.model(*inputs)
                except _OutOfRange as found:
                    raise InvalidBatchError(str(found)) from None
                except Exception:  # not an id out of range: the first error says what
                    pass
                raise error

    def _fixed_weights(self) -> dict[int, tuple[str, int]]:
        """Each fixed table's rows as the model reads them, by address: name, row count."""
        return {
            self.store.tables[name].weight.data_ptr(): (name, spec.num_rows)
            for name, spec in self.plan.tables.items()
            if spec.dynamic is None and spec.num_rows
        }


class _OutOfRange(Exception):
    """A lookup of an id outside a fixed table's rows, found by :class:`_LookupChecks`."""


class _LookupChecks(TorchFunctionMode):
    """Checks the ids of every embedding lookup in a fixed table before it runs, raising
    :class:`_OutOfRange` with the first id outside the table's rows, the table and the input
    whose storage the ids are (a view of: a column, a slice)."""

    def __init__(
        self,
        tables: Mapping[int, tuple[str, int]],
        inputs: Sequence[Tensor],
        names: Sequence[str] | None,
    ):
        super().__init__()
        self.tables = tables
        labels = names or [f"input_{i}" for i in range(len(inputs))]
        self.inputs = {
            t.untyped_storage().data_ptr(): label for t, label in zip(inputs, labels, strict=True)
        }

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (F.embedding, F.embedding_bag):
            ids = args[0] if args else kwargs.get("input")
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if isinstance(ids, Tensor) and isinstance(weight, Tensor):
                self._check(ids, weight)
        return func(*args, **kwargs)

    def _check(self, ids: Tensor, weight: Tensor) -> None:
        table = self.tables.get(weight.data_ptr())
        if table is None or not ids.numel():
            return
        name, rows = table
        low, high = int(ids.min()), int(ids.max())
        if low >= 0 and high < rows:
            return
        source = self.inputs.get(ids.untyped_storage().data_ptr())
        holder = f"input {source!r} holds" if source else "ids computed from the inputs hold"
        raise _OutOfRange(
            f"{holder} id {low if low < 0 else high} for table {name!r}, whose ids are "
            f"0..{rows - 1}"
        )
