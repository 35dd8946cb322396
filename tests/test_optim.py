"""Row-wise Adagrad, the one update rule written here (the others are torch.optim's functional
steps, checked against torch.optim in test_parity.py), against its formula computed directly;
tables updated together as each alone; rows taken and put back as torch's indexing does."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from paramserver.optim import RowUpdate, RowWiseAdagrad, make_rule
from paramserver.optimconfig import OptimizerConfig
from paramserver.rowupdates import apply_rows, apply_updates, put_rows, take_rows

# Every test runs with the compiled loops and with numpy only (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("loop_mode")

NUM_ROWS, DIM = 6, 4
# Rows touched at each step: rows 0 and 3 every time, row 5 never, the others now and then, so
# rows reach different step counts and accumulator values.
TOUCHED = [[0, 1, 3], [3, 0, 2], [4, 0, 3, 1], [0, 3]]


def by_formula(
    weight: Tensor, grads: list[Tensor], lr: float, eps: float, weight_decay: float, init: float
) -> Tensor:
    """FBGEMM's row-wise Adagrad, one row at a time in float64: g = grad + wd * w;
    s += mean(g ** 2); w -= lr * g / (sqrt(s) + eps)."""
    w = weight.double().clone()
    s = torch.full((NUM_ROWS,), init, dtype=torch.float64)
    for rows, grad in zip(TOUCHED, grads, strict=True):
        for row, g in zip(rows, grad.double(), strict=True):
            g = g + weight_decay * w[row]
            s[row] += float((g * g).sum()) / DIM
            w[row] -= lr * g / (s[row].sqrt() + eps)
    return w


@pytest.mark.parametrize(
    ("weight_decay", "eps", "init"),
    [(0.0, None, 0.0), (0.1, None, 0.0), (0.0, 0.5, 0.0), (0.05, 1e-3, 0.2)],
)
@pytest.mark.parametrize("keep_steps", [False, True])
def test_rowwise_adagrad_follows_its_formula_row_by_row(
    weight_decay: float, eps: float | None, init: float, keep_steps: bool
) -> None:
    config = OptimizerConfig(
        name="rowwise_adagrad", lr=0.3, weight_decay=weight_decay, eps=eps,
        initial_accumulator_value=init,
    )  # fmt: skip
    rule = make_rule(config)
    assert isinstance(rule, RowWiseAdagrad) and not rule.needs_steps
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(NUM_ROWS, DIM, generator=g)
    start = weight.clone()
    state = rule.init_state(weight)
    assert state["sum"].shape == (NUM_ROWS, 1)  # one accumulator per row
    # Tables of this rule keep no step counts; given some (rows at different counts), the
    # math must not change.
    steps = torch.tensor([0.0, 7.0, 1.0, 2.0, 0.0, 3.0]) if keep_steps else None
    grads = [torch.randn(len(rows), DIM, generator=g) * 3 for rows in TOUCHED]
    for rows, grad in zip(TOUCHED, grads, strict=True):
        apply_rows(rule, weight, state, steps, torch.tensor(rows), grad, config.lr)
    expected = by_formula(start, grads, 0.3, config.resolved_eps, weight_decay, init)
    torch.testing.assert_close(weight.double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(weight[5], start[5])  # never touched
    touched_count = torch.zeros(NUM_ROWS)
    for rows in TOUCHED:
        touched_count[rows] += 1
    if steps is not None:
        assert steps.tolist() == [4.0, 9.0, 2.0, 6.0, 1.0, 3.0]
    # The accumulator only grows where a row was touched, and holds the mean squared gradient.
    assert bool((state["sum"][touched_count == 0] == init).all())
    assert bool((state["sum"][touched_count > 0] > init).all())


def test_rowwise_adagrad_first_step_moves_each_row_by_lr_over_its_rms() -> None:
    """One step from a zero accumulator: w -= lr * g / (rms(g) + eps), so every row moves by
    about lr in root-mean-square, whatever its gradient's scale."""
    rule = make_rule(OptimizerConfig(name="rowwise_adagrad", lr=0.5))
    weight = torch.zeros(3, DIM)
    state = rule.init_state(weight)
    grad = torch.tensor([[1.0, -1.0, 1.0, -1.0], [100.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    apply_rows(rule, weight, state, None, torch.arange(3), grad, 0.5)
    assert weight[0].tolist() == pytest.approx([-0.5, 0.5, -0.5, 0.5])
    assert weight[1].tolist() == pytest.approx([-1.0, 0.0, 0.0, 0.0])  # rms of [100,0,0,0] = 50
    assert weight[2].tolist() == [0.0] * DIM  # no gradient, no move (eps keeps it finite)
    assert state["sum"].squeeze(1).tolist() == pytest.approx([1.0, 2500.0, 0.0])


RULE_CONFIGS = [
    OptimizerConfig(name="sgd", lr=0.1),
    OptimizerConfig(name="sgd", lr=0.1, weight_decay=0.01),
    OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, dampening=0.1),
    OptimizerConfig(name="sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    OptimizerConfig(name="adagrad", lr=0.1),
    OptimizerConfig(
        name="adagrad",
        lr=0.1,
        adagrad_lr_decay=0.05,
        initial_accumulator_value=0.1,
        weight_decay=0.01,
    ),
    OptimizerConfig(name="rowwise_adagrad", lr=0.1, weight_decay=0.01),
    OptimizerConfig(name="adam", lr=0.01),
    OptimizerConfig(name="adam", lr=0.01, weight_decay=0.01, betas=(0.8, 0.9)),
]


@pytest.mark.parametrize("config", RULE_CONFIGS, ids=lambda c: f"{c.name}")
def test_tables_updated_together_equal_each_alone(config: OptimizerConfig) -> None:
    """apply_updates over several tables (one torch.optim call for all where the rule takes
    lists) leaves every value, state slot and step count bitwise as apply_rows table by table,
    over steps that bring rows to different step counts (each table its own rows and dims)."""
    rule = make_rule(config)
    g = torch.Generator().manual_seed(1)
    shapes = [(50, 8), (40, 8), (30, 5)]

    def tables() -> list[tuple[Tensor, dict[str, Tensor], Tensor | None]]:
        made = []
        for num_rows, dim in shapes:
            weight = torch.randn(num_rows, dim, generator=torch.Generator().manual_seed(num_rows))
            steps = torch.zeros(num_rows) if rule.needs_steps else None
            made.append((weight, rule.init_state(weight), steps))
        return made

    together, alone = tables(), tables()
    for lr in (0.1, 0.05, 0.2, 0.1):
        updates = []
        for (weight, state, steps), (num_rows, dim) in zip(together, shapes, strict=True):
            rows = torch.randperm(num_rows, generator=g)[: num_rows // 2].sort().values
            grads = torch.randn(rows.numel(), dim, generator=g)
            updates.append(RowUpdate(weight, state, steps, rows, grads))
        apply_updates(rule, updates, lr)
        for (weight, state, steps), update in zip(alone, updates, strict=True):
            apply_rows(rule, weight, state, steps, update.rows, update.grads, lr)
    for (w1, s1, c1), (w2, s2, c2), (start, _, _) in zip(together, alone, tables(), strict=True):
        assert not torch.equal(w1, start), "the test is vacuous"
        assert torch.equal(w1, w2)
        assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
        assert (c1 is None and c2 is None) or (c1 is not None and torch.equal(c1, c2))
        if c1 is not None:
            assert len(set(c1.tolist())) > 1  # rows at different step counts


@pytest.mark.parametrize("config", RULE_CONFIGS, ids=lambda c: f"{c.name}")
def test_apply_rows_equals_the_rule_step_on_each_row_group(config: OptimizerConfig) -> None:
    """apply_rows (gather, one step per step-count group, scatter) against the rule's own step
    on each row alone (a block of one row, its own step count): the same values bitwise."""
    rule = make_rule(config)
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(20, 6, generator=g)
    state = rule.init_state(weight)
    steps = torch.zeros(20) if rule.needs_steps else None
    by_row = weight.clone()
    row_state = {k: v.clone() for k, v in state.items()}
    row_steps = torch.zeros(20)
    for _ in range(3):
        rows = torch.randperm(20, generator=g)[:12].sort().values
        grads = torch.randn(12, 6, generator=g)
        apply_rows(rule, weight, state, steps, rows, grads, 0.1)
        for row, grad in zip(rows.tolist(), grads, strict=True):
            block = by_row[row : row + 1]
            block_state = {k: v[row : row + 1] for k, v in row_state.items()}
            count = row_steps[row].clone() if rule.needs_steps else torch.zeros(())
            rule.step(block, grad.unsqueeze(0), block_state, count, 0.1)
            row_steps[row] += 1
    assert torch.equal(weight, by_row)
    assert all(torch.equal(state[k], row_state[k]) for k in state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [1, 5])
@pytest.mark.parametrize("contiguous", [True, False])
def test_rows_are_taken_and_put_as_torch_indexing_does(
    dtype: torch.dtype, dim: int, contiguous: bool
) -> None:
    """take_rows and put_rows (row bytes through numpy where the tensors are contiguous,
    torch's indexing otherwise) give index_select's and index_copy_'s results bitwise."""
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(40, 2 * dim, generator=g).to(dtype)
    table = whole[:, :dim] if not contiguous else whole[:, :dim].contiguous()
    assert table.is_contiguous() == contiguous
    rows = torch.tensor([7, 0, 39, 12])
    assert torch.equal(take_rows(table, rows.numpy()), table.index_select(0, rows))
    values = torch.randn(4, dim, generator=g).to(dtype)
    expected = table.clone().index_copy_(0, rows, values)
    put_rows(table, rows.numpy(), values)
    assert torch.equal(table, expected)
    empty = take_rows(table, rows[:0].numpy())
    assert empty.shape == (0, dim) and empty.dtype == dtype
