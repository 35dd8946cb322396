"""What every process of a job derives the same way from the user's ``model_fn``: the seeded
model, its embedding tables and its shard plan.

Servers and trainers never exchange the model. Each calls :func:`build_model` with the job's
seed: the model with its fixed tables on the meta device, and each table's
:class:`~paramserver.tableinit.RowInit`, from which a server makes the rows it owns (and the
single-process reference the whole table): the same values everywhere, whatever the number of
servers. Dense parameters and buffers are built by ``model_fn`` itself, under the same seeds.
Each process calls :func:`plan_of` on its build and gets the same
:class:`~paramserver.sharding.ShardPlan`, whose fingerprint they compare at start-up. Tables are
the model's ``nn.Embedding``, ``nn.EmbeddingBag`` and
:class:`~paramserver.embedding.DynamicEmbedding` weights, one table per weight, named by the
weight's first state_dict name (``emb.0.weight``); a weight shared by several layers (one item
table for a history bag and a target item) or registered on another module too is one table
with other names (:func:`table_aliases`). Every other parameter is dense.
"""

from __future__ import annotations

import copy
import logging
import operator
import random
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from paramserver.embedding import DynamicEmbedding
from paramserver.errors import ModelError
from paramserver.sharding import DenseSpec, ShardPlan, TableSpec
from paramserver.tableinit import InitRecorder, Recording, RecordingTables, RowInit
from paramserver.types import ModelFn

log = logging.getLogger(__name__)

EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)  # torch's own embedding layers
SERVED = (nn.Embedding, nn.EmbeddingBag, DynamicEmbedding)  # every layer that becomes a table
Embedding = nn.Embedding | nn.EmbeddingBag | DynamicEmbedding


SEEDING = threading.RLock()
"""Held while a model is built under the seeds, and by whoever else seeds the process's RNGs:
trainers that are threads of one process build at once."""


def seeded_model(model_fn: ModelFn, seed: int) -> nn.Module:
    """``model_fn()`` under fixed seeds: every process (and thread) that calls this gets the
    same values. The model is :func:`owned`: a build shares no module with another."""
    with SEEDING:
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        model = model_fn()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn must return an nn.Module, got {type(model).__name__}")
    return owned(model)


def owned(model: nn.Module) -> nn.Module:
    """``model`` with modules, dense parameters and buffers of its own.

    Libraries may hand every ``model_fn()`` call the same layers: torch-rechub caches each
    feature's ``nn.Embedding`` on the feature object, so two models built from one feature
    list share their tables' modules. paramserver builds the model several times in a process
    (to plan, to train, to return the result, for the reference), and a build it changes
    (tables made remote, trained values loaded) or returns must not change another, nor the
    user's own model. Table weights are kept, not copied: they are meta placeholders or
    values given whole, replaced where a build needs values, never written in place. A model
    that cannot be copied is used as it is (logged)."""
    keep: dict[int, Any] = {id(m.weight): m.weight for m in find_embeddings(model).values()}
    try:
        return copy.deepcopy(model, memo=keep)
    except Exception as error:  # an attribute deepcopy refuses (a lock, a generator)
        log.warning(
            "the model cannot be copied (%s): if model_fn hands several calls the same "
            "layers, the builds of this process share them",
            error,
        )
        return model


@dataclass
class BuiltModel:
    """A model as every process of a job builds it: fixed tables on the meta device, unless
    ``model_fn`` needs their values, and how each fixed table's rows start."""

    model: nn.Module
    inits: dict[str, RowInit]


def build_model(model_fn: ModelFn, seed: int, *, table_values: bool = True) -> BuiltModel:
    """``model_fn()`` under fixed seeds with its fixed tables' weights on the meta device and
    their initialisation recorded (see :mod:`paramserver.tableinit`).

    Where ``model_fn`` cannot build without its tables' values (it reads them, or computes
    another tensor from them), the model is built whole; where a table's initialisation cannot
    be replayed row by row, it is built whole once for that table's values (unless
    ``table_values`` is False: a trainer's build, whose ``inits`` then lack those tables). Both
    are logged with the memory they take."""
    try:
        with RecordingTables() as recorder:
            model = seeded_model(model_fn, seed)
    except Exception as error:
        return _built_whole(
            model_fn, seed, f"model_fn failed with them on the meta device ({error})"
        )
    if _leaked(model):
        return _built_whole(model_fn, seed, "model_fn computes other tensors from their values")
    inits: dict[str, RowInit] = {}
    unreplayable: dict[str, str] = {}
    for name, module in _fixed_tables(model).items():
        weight = module.weight
        if not weight.is_meta:  # values model_fn gave (from_pretrained, _weight=...)
            inits[name] = RowInit.given(name, weight)
            continue
        recording = _recording(recorder, weight)
        if recording.unreplayable is not None:
            unreplayable[name] = recording.unreplayable
        else:
            shape = (
                table_size(module, name, "num_embeddings"),
                table_size(module, name, "embedding_dim"),
            )
            inits[name] = RowInit(name, shape, weight.dtype, recording.steps, seed)
    if unreplayable and table_values:
        inits.update(_tables_built_whole(model_fn, seed, unreplayable))
    return BuiltModel(model, inits)


_CARRIED = "_paramserver_init"  # a table's meta weight's attribute: how it was initialised


def _recording(recorder: InitRecorder, weight: Tensor) -> Recording:
    """How ``weight``, a table's meta weight, was initialised: as this build recorded it, or,
    where this build did nothing to it, as the build that made it recorded it (a library that
    caches layers between ``model_fn()`` calls hands later builds the first one's weight).
    The weight carries its recording, so it travels where the weight is pickled (a
    ``model_fn`` closing over the cache, sent to a worker process)."""
    recording = recorder.of(weight)
    if recording.steps or recording.unreplayable is not None:
        weight.__dict__[_CARRIED] = recording
        return recording
    carried: Recording = weight.__dict__.get(_CARRIED, recording)
    return carried


def _built_whole(model_fn: ModelFn, seed: int, why: str) -> BuiltModel:
    model = seeded_model(model_fn, seed)
    tables = _fixed_tables(model)
    megabytes = sum(m.weight.numel() * m.weight.element_size() for m in tables.values()) / 2**20
    log.info("tables built whole (%.0f MB in this process): %s", megabytes, why)
    return BuiltModel(model, {name: RowInit.given(name, m.weight) for name, m in tables.items()})


def _tables_built_whole(model_fn: ModelFn, seed: int, why: dict[str, str]) -> dict[str, RowInit]:
    """The given tables' values from one whole build of the model (its other tables dropped)."""
    whole = _fixed_tables(seeded_model(model_fn, seed))
    for name, reason in why.items():
        weight = whole[name].weight
        log.warning(
            "table %s: its initialisation cannot be replayed row by row (%s), so every process "
            "that needs its values builds the model whole once (%.0f MB for this table); use "
            "nn.init's normal_, uniform_, trunc_normal_ or constant_ on it to avoid this",
            name, reason, weight.numel() * weight.element_size() / 2**20,
        )  # fmt: skip
    return {name: RowInit.given(name, whole[name].weight) for name in why}


def _fixed_tables(model: nn.Module) -> dict[str, nn.Embedding | nn.EmbeddingBag]:
    return {n: m for n, m in find_embeddings(model).items() if isinstance(m, EMBEDDINGS)}


def _leaked(model: nn.Module) -> bool:
    """Whether a tensor other than a table's weight is on the meta device (a parameter,
    buffer or attribute computed from a table's values, which could not be given any)."""
    weights = {id(m.weight) for m in find_embeddings(model).values()}
    for module in model.modules():
        tensors = [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]
        if any(isinstance(t, Tensor) and t.is_meta and id(t) not in weights for t in tensors):
            return True
    return False


def initial_model(model_fn: ModelFn, seed: int = 0) -> nn.Module:
    """The model a job with ``config.seed == seed`` starts from, whole, in this process (the
    public ``paramserver.initial_model``): train it in one process to compare with a job from
    the same start. ``torch.manual_seed(seed); model_fn()`` is another model: a job makes each
    table's rows from the seed row by row (any server makes the rows it owns, alone), so the
    tables' values, and the draws of every layer built after them, differ. It is
    :func:`build_model`'s, with every fixed table's weight made from its
    :class:`~paramserver.tableinit.RowInit`; it shares no module with the user's objects."""
    built = build_model(model_fn, seed)
    for name, module in _fixed_tables(built.model).items():
        weight = module.weight  # given values too: copied, so training this model leaves them
        rows = built.inits[name].rows(torch.arange(module.num_embeddings))
        replace_parameter(built.model, weight, nn.Parameter(rows, weight.requires_grad))
    return built.model


def replace_parameter(model: nn.Module, old: Tensor, new: nn.Parameter) -> None:
    """``new`` in place of ``old`` wherever a module holds it (a shared weight stays shared)."""
    for module in model.modules():
        for key, value in module._parameters.items():
            if value is old:
                module._parameters[key] = new


def find_embeddings(model: nn.Module) -> dict[str, Embedding]:
    """The model's tables: its served embedding layers, one per weight (the first layer that
    holds it), by the weight's first state_dict name."""
    found: dict[str, Embedding] = {}
    weights: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, SERVED) and id(module.weight) not in weights:
            weights.add(id(module.weight))
            found[f"{name}.weight" if name else "weight"] = module
    return found


def table_aliases(model: nn.Module) -> dict[str, str]:
    """The other state_dict names of the tables' weights (a weight shared by several layers,
    or registered on another module too), each with its table's name."""
    tables = {id(m.weight): name for name, m in find_embeddings(model).items()}
    return {
        name: tables[id(value)]
        for name, value in model.state_dict(keep_vars=True).items()
        if id(value) in tables and tables[id(value)] != name
    }


def load_job_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Load a job's ``state`` (each table once, by its name) into ``model``, a build of the
    job's ``model_fn``, taking the tensors as they are (``assign``): a weight shared by
    several layers is shared again."""
    aliases = table_aliases(model)
    model.load_state_dict({**state, **{a: state[t] for a, t in aliases.items()}}, assign=True)
    for alias, table in aliases.items():
        holder, _, key = alias.rpartition(".")
        model.get_submodule(holder)._parameters[key] = model.get_parameter(table)


def table_size(module: Embedding, name: str, attribute: str) -> int:
    """A table's ``num_embeddings`` or ``embedding_dim`` as an int: numpy's and every other
    integer type torch takes are accepted; anything else is refused naming the table."""
    value = getattr(module, attribute)
    try:
        size = operator.index(value)
    except TypeError:
        raise ModelError(
            f"table {name}: {attribute} must be an integer, got {value!r} ({type(value).__name__})"
        ) from None
    if size < 0:
        raise ModelError(f"table {name}: {attribute} must be >= 0, got {size}")
    return size


def plan_of(model: nn.Module, num_servers: int, dense_on_servers: bool = True) -> ShardPlan:
    """The shard plan of ``model``: its embedding weights become tables, the rest dense (on
    the servers, or kept by the trainers: ``dense_on_servers`` False), its persistent buffers
    on the servers."""
    tables = find_embeddings(model)
    table_weights = {id(module.weight) for module in tables.values()}
    dense = [
        DenseSpec(name, tuple(p.shape), p.dtype)
        for name, p in model.named_parameters()
        if id(p) not in table_weights
    ]
    specs = [
        TableSpec(
            name,
            0 if isinstance(m, DynamicEmbedding) else table_size(m, name, "num_embeddings"),
            table_size(m, name, "embedding_dim"),
            m.weight.dtype,
            dynamic=m.options if isinstance(m, DynamicEmbedding) else None,
        )
        for name, m in tables.items()
    ]
    persistent = set(model.state_dict(keep_vars=True))
    # A table layer's own buffers (a dynamic table's ids) are not the model's state.
    holders = {name for name, m in model.named_modules() if isinstance(m, SERVED)}
    buffers = [
        DenseSpec(name, tuple(b.shape), b.dtype)
        for name, b in model.named_buffers()
        if name in persistent and name.rpartition(".")[0] not in holders
    ]
    return ShardPlan(
        dense, specs, num_servers, dense_on_servers, table_aliases(model), buffers=buffers
    )
