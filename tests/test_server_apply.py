"""A server applies a push's gradients to all its tables of one rule and learning rate at once
(one torch.optim call over their gathered rows, and one over its dense parameters): every
value, state slot, step count and counter ends bitwise as applying each table and dense
parameter alone, for every rule, with tables of other rules, rates and kinds beside them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from paramserver.config import ShardSettings
from paramserver.embedding import DynamicOptions
from paramserver.optimconfig import OptimizerConfig
from paramserver.server.decoded import RowGrads
from paramserver.server.shard import ServerShard
from paramserver.sharding import DenseSpec, ShardPlan, TableSpec
from paramserver.store.table import Reading
from paramserver.tableinit import RowInit

RULES = [
    OptimizerConfig(name="sgd", lr=0.1, weight_decay=0.01),
    OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, nesterov=True),
    OptimizerConfig(name="adagrad", lr=0.1),
    OptimizerConfig(name="adagrad", lr=0.1, adagrad_lr_decay=0.1, initial_accumulator_value=0.2),
    OptimizerConfig(name="rowwise_adagrad", lr=0.1),
    OptimizerConfig(name="adam", lr=0.01, weight_decay=0.01),
]
# Tables a, b, d share the rule under test; c has another lr (its own group), e another rule.
FIXED, DYNAMIC = ("a", "b", "c", "e"), ("d",)


def make_shard(rule: OptimizerConfig) -> ServerShard:
    tables = [TableSpec(n, 40, 4, torch.float32) for n in FIXED]
    tables.append(TableSpec("d", 0, 4, torch.float32, dynamic=DynamicOptions()))
    dense = [DenseSpec("w1", (3, 5), torch.float32), DenseSpec("w2", (5,), torch.float32)]
    plan = ShardPlan(dense, tables, num_servers=1)
    rules = dict.fromkeys("abd", rule)
    rules["c"] = dataclasses.replace(rule, lr=rule.lr / 2)
    rules["e"] = OptimizerConfig(name="sgd", lr=0.3)
    # Row-wise Adagrad is a rule of tables only.
    dense_rule = rule if rule.name != "rowwise_adagrad" else OptimizerConfig(name="adagrad")
    settings = ShardSettings(
        dense_rule=dense_rule, table_rules=rules, table_pull_codecs=dict.fromkeys(rules, "none"),
        dense_pull_codec="none", cache_lag=None,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    values = {"w1": torch.randn(3, 5, generator=g), "w2": torch.randn(5, generator=g)}
    inits = {n: RowInit.given(n, torch.randn(40, 4, generator=g)) for n in FIXED}
    shard = ServerShard(0, plan, values, inits, settings)
    shard.store.tables["d"].read(torch.arange(0, 80, 2), Reading(train=True))  # rows exist
    return shard


def pushes(seed: int) -> list[tuple[dict[str, Tensor], dict[str, RowGrads]]]:
    g = torch.Generator().manual_seed(seed)
    made = []
    for _ in range(4):
        dense = {"w1": torch.randn(3, 5, generator=g), "w2": torch.randn(5, generator=g)}
        rows = {}
        for name in (*FIXED, *DYNAMIC):
            ids = torch.randperm(40, generator=g)[:15].sort().values * (2 if name == "d" else 1)
            rows[name] = RowGrads(ids, torch.randn(15, 4, generator=g))
        made.append((dense, rows))
    return made


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_a_push_applied_together_equals_each_table_alone(rule: OptimizerConfig) -> None:
    together, alone = make_shard(rule), make_shard(rule)
    for step, (dense, rows) in enumerate(pushes(1)):
        together.apply(dense, rows, clock=step, step=step)
        dense_lr, table_lrs = alone.store.learning_rates(step, dense, rows)
        for name, grad in dense.items():
            slot = alone.store.dense[name]
            slot.rule.step(slot.value, grad, slot.state, slot.version, dense_lr)
        for name, block in rows.items():
            alone.store.tables[name].apply(block.ids, block.values, step, lr=table_lrs[name])
    got = together.store.export_state(with_optimizer=True)
    want = alone.store.export_state(with_optimizer=True)
    assert got.keys() == want.keys()
    for name, entry in want.items():
        assert entry.keys() == got[name].keys()
        for key, value in entry.items():
            assert torch.equal(got[name][key], value), f"{name} {key}"
    assert together.stats.rows_updated == 4 * 15 * 5
    start = make_shard(rule).store.export_state()
    assert all(not torch.equal(got[n]["value"], start[n]["value"]) for n in got), "vacuous"
