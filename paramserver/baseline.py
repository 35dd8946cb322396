"""Single-process training in plain PyTorch: the reference paramserver is measured against.

The fastest plain-PyTorch way for models with large tables: embeddings produce sparse
gradients (``sparse=True``) and the optimizer updates only touched rows (SGD and Adagrad take
sparse gradients; Adam's tables use SparseAdam). Batches of all trainers are interleaved in
the order a sync job would see them.

:class:`~paramserver.DynamicEmbedding` tables are trained with the servers' own table code,
in this process: a :class:`~paramserver.store.store.Store` of them, each with its update
rule. A forward pass loads the rows its ids read (admitting and creating them as a server's
training read does, at the step's clock: the sync round), and their gradients are applied
after the backward pass, summed per id, at the next step's clock (a trainer pushes them with
its next call). So a Criteo job on hashed ids has a reference too.

Learning-rate schedules apply as on the servers: every batch of round ``r`` (one batch of each
trainer) is trainer step ``r // accumulate`` and is applied at that step's rate, through
``torch.optim.lr_scheduler.LambdaLR`` for the optimizers and the rule's own rate for dynamic
tables.
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Sequence
from itertools import zip_longest
from typing import Any

import torch
from torch import Tensor, nn

from paramserver.config import TrainConfig
from paramserver.embedding import DynamicEmbedding
from paramserver.errors import ConfigError
from paramserver.modelplan import EMBEDDINGS, find_embeddings, initial_model, plan_of
from paramserver.optimconfig import OptimizerConfig
from paramserver.sharding import ShardPlan
from paramserver.store.store import Store
from paramserver.store.table import Reading
from paramserver.types import Batch, DataFn, LossFn, ModelFn, as_tuple


def make_optimizers(model: nn.Module, config: TrainConfig) -> list[torch.optim.Optimizer]:
    """The dense parameters' optimizer and one per table, as ``config`` sets them.

    Row-wise Adagrad has no torch.optim counterpart; plain Adagrad stands in for it here.
    """
    return [optimizer for optimizer, _ in optimizers_by_group(model, config).values()]


def optimizers_by_group(
    model: nn.Module, config: TrainConfig
) -> dict[str, tuple[torch.optim.Optimizer, OptimizerConfig]]:
    """:func:`make_optimizers`' optimizers by group (``"dense"``, each fixed table by name),
    each with the rule it follows."""
    tables = {n: m for n, m in find_embeddings(model).items() if isinstance(m, EMBEDDINGS)}
    # A DynamicEmbedding's weight is the rows a step loaded (InProcessTables updates them).
    hashed = [m.weight for m in model.modules() if isinstance(m, DynamicEmbedding)]
    table_ids = {id(w) for w in [*[m.weight for m in tables.values()], *hashed]}
    dense = [p for p in model.parameters() if id(p) not in table_ids]
    rule = config.dense_optimizer()
    optimizers = {"dense": (_optimizer(dense, rule, sparse=False), rule)}
    for module in model.modules():
        if isinstance(module, EMBEDDINGS):
            module.sparse = True
    for name, module in tables.items():
        rule = config.table_optimizer_for(name)
        optimizers[name] = (_optimizer([module.weight], rule, sparse=True), rule)
    return optimizers


def lr_schedulers(
    optimizers: dict[str, tuple[torch.optim.Optimizer, OptimizerConfig]],
) -> list[torch.optim.lr_scheduler.LambdaLR]:
    """A LambdaLR per optimizer, following its rule's schedule (at step 0 once made)."""
    return [
        torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(rule.lr_factor, group=name))
        for name, (optimizer, rule) in optimizers.items()
    ]


def _optimizer(params: Sequence[Tensor], c: OptimizerConfig, sparse: bool) -> torch.optim.Optimizer:
    if c.name == "sgd":
        return torch.optim.SGD(
            params,
            lr=c.lr,
            momentum=c.momentum,
            dampening=c.dampening,
            nesterov=c.nesterov,
            weight_decay=c.weight_decay,
        )
    if c.name in ("adagrad", "rowwise_adagrad"):
        return torch.optim.Adagrad(
            params,
            lr=c.lr,
            lr_decay=c.adagrad_lr_decay,
            weight_decay=c.weight_decay,
            initial_accumulator_value=c.initial_accumulator_value,
            eps=c.resolved_eps,
        )
    if sparse:
        if c.weight_decay:
            raise ConfigError("the single-process reference (SparseAdam) has no weight decay")
        return torch.optim.SparseAdam(params, lr=c.lr, betas=c.betas, eps=c.resolved_eps)
    return torch.optim.Adam(
        params, lr=c.lr, betas=c.betas, eps=c.resolved_eps, weight_decay=c.weight_decay
    )


class InProcessTables:
    """The model's DynamicEmbedding tables, each a server's table in this process (see the
    module docstring)."""

    def __init__(self, model: nn.Module, config: TrainConfig):
        found = find_embeddings(model)
        self.modules = {n: m for n, m in found.items() if isinstance(m, DynamicEmbedding)}
        plan = plan_of(model, 1)
        settings = config.shard_settings(plan.tables)
        dynamic = ShardPlan([], [plan.tables[name] for name in self.modules], 1)
        self.store = Store(0, dynamic, {}, {}, settings.dense_rule, settings.table_rules)
        self.loaded: dict[str, list[tuple[Tensor, nn.Parameter]]] = {n: [] for n in self.modules}
        self.clock = 0
        self.step = 0  # the training step whose learning rate applies
        self._hooks = [
            module.register_forward_pre_hook(functools.partial(self._load, name))
            for name, module in self.modules.items()
        ]

    def _load(self, name: str, module: DynamicEmbedding, args: tuple[Any, ...]) -> None:
        """Before ``module`` runs: give it the rows of the ids it is called with."""
        ids = torch.unique(args[0].to(torch.int64))
        reading = Reading(train=module.training, clock=self.clock)
        values = self.store.read({name: ids}, reading).values[name]
        weight = nn.Parameter(values, requires_grad=module.training)
        module.ids, module.weight = ids, weight
        if module.training:
            self.loaded[name].append((ids, weight))

    @torch.no_grad()
    def apply(self) -> None:
        """After a backward pass: each table's gradients, summed per id, through its rule."""
        for name, loaded in self.loaded.items():
            if loaded:
                ids = torch.cat([ids for ids, _ in loaded])
                grads = torch.cat([_grad_of(w) for _, w in loaded])
                unique, inverse = torch.unique(ids, return_inverse=True)
                summed = torch.zeros(unique.numel(), grads.shape[1]).index_add_(0, inverse, grads)
                # A server applies a step's gradients with the next call, at its clock.
                _, lrs = self.store.learning_rates(self.step, (), (name,))
                self.store.apply_rows({name: (unique, summed)}, lrs, self.clock + 1)
                loaded.clear()

    def finish(self) -> None:
        """Every table's rows into its module (a plain model, as one gathered from servers)."""
        for hook in self._hooks:
            hook.remove()
        rows = self.store.export_state()
        for name, module in self.modules.items():
            module.ids, module.weight = rows[name]["ids"], nn.Parameter(rows[name]["value"])


def _grad_of(weight: nn.Parameter) -> Tensor:
    return torch.zeros_like(weight) if weight.grad is None else weight.grad


def train_single_process(
    model_fn: ModelFn, data_fn: DataFn, loss_fn: LossFn, config: TrainConfig
) -> tuple[nn.Module, dict[str, Any]]:
    """Train on every trainer's batches in one process; returns the model and throughput."""
    torch.set_num_threads(config.threads_per_process)
    model = initial_model(model_fn, config.seed)
    model.train()
    dynamic = InProcessTables(model, config)
    by_group = optimizers_by_group(model, config)
    optimizers = [optimizer for optimizer, _ in by_group.values()]
    schedulers = lr_schedulers(by_group)
    samples = steps = rounds = 0
    started = time.perf_counter()
    for _ in range(config.epochs):
        streams = [data_fn(t, config.trainers) for t in range(config.trainers)]
        for batches in zip_longest(*streams):
            dynamic.clock = rounds  # a sync round's step: the servers' clock
            dynamic.step = rounds // config.accumulate  # the trainers' step: its lr
            for batch in batches:
                if batch is not None:
                    samples += _step(model, batch, loss_fn, optimizers, dynamic)
                    steps += 1
            rounds += 1
            if rounds % config.accumulate == 0:
                for scheduler in schedulers:  # the next trainer step's learning rate
                    scheduler.step()
            if config.steps is not None and steps >= config.steps * config.trainers:
                break
    seconds = time.perf_counter() - started
    dynamic.finish()
    for module in model.modules():
        if isinstance(module, EMBEDDINGS):
            module.sparse = False
    return model, {
        "samples": samples,
        "steps": steps,
        "seconds": seconds,
        "samples_per_s": samples / seconds if seconds else 0.0,
    }


def _step(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    optimizers: list[torch.optim.Optimizer],
    dynamic: InProcessTables,
) -> int:
    """One batch's update; returns its samples."""
    inputs, target = batch
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    loss_fn(model(*as_tuple(inputs)), target).backward()
    dynamic.apply()
    with warnings.catch_warnings():  # torch warns at each sparse step: noise here
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        for optimizer in optimizers:
            optimizer.step()
    return int(target.shape[0])
