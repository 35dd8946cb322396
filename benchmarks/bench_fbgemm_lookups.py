"""FBGEMM's CPU table-batched embedding (TBE) beside torch's ``F.embedding_bag`` for the pooled
lookups a trainer runs over the rows it pulled (issue 47, item 5): what each costs, and whether
the two agree bit for bit.

A trainer pulls, per table, the sorted unique rows its batch touches into a leaf ``[n, dim]``
tensor and runs the model's EmbeddingBag lookups over it, with the ids remapped to positions in
it (``RemoteTable.lookup``): one ``F.embedding_bag`` per table, whose dense backward sorts the
ids and adds each id's pooled gradient into its row. This script builds those inputs from
``bench_field``'s ``bags`` workload (10 sum bags of dim 16 over 2k-100k rows, 1-10 uniform ids
per bag; :mod:`field_models`) and compares, on the same steps:

- ``torch``: ``F.embedding_bag`` per table over its pulled rows, then the backward of every
  table's pooled output (what a trainer does today);
- ``fbgemm``: FBGEMM's CPU dense TBE once over all tables
  (``torch.ops.fbgemm.dense_embedding_codegen_lookup_function``, the op that
  ``DenseTableBatchedEmbeddingBagsCodegen.forward`` calls: no optimizer, it leaves the dense
  gradient of its weights in ``.grad``). Its weights are one flat tensor of every table, so each
  step pays ``pack``: the pulled rows (one tensor per table) copied into it, the ids and offsets
  concatenated, the tables' offsets built (their row counts change every step).

A third entry, ``torch_sort_alone``, times only the default ``torch.sort`` of each table's ids:
what torch's backward does first, and the order any lookup keeping torch's bits must add in.

Timing: CPU time of this thread per phase (``time.thread_time``; one torch thread, as trainers
run, so every kernel and the backward run in it), the median over ``--steps`` steps, the
entries taking turns to go first. Both lookups get the same upstream gradient of the pooled
outputs. Not timed: pulling and remapping ids (the same for both).

Bitwise check, on ``--check-steps`` steps of each batch size: pooled outputs and row gradients
of both, for ``sum``, ``mean``, and ``sum`` with per-sample weights (and their gradient). Where
gradients differ, the rows that differ are counted by how many ids of the step hit them, and
each lookup's row gradients are compared with a reference that adds each id's scaled pooled
gradient into its row by a fused multiply-add (:func:`fused_in_order`), the ids taken in
occurrence order or in ``torch.sort``'s order: which order each lookup adds in. The premise is
checked too: torch over the pulled rows equals torch over the whole tables (the one-process
reference) at the pulled rows.

FBGEMM is not a dependency of the project; this runs in a venv of its own with the CPU wheel
(``fbgemm-gpu-cpu==1.8.0`` loads with torch 2.13.0 here)::

    .venv/bin/python -m venv /tmp/fbvenv
    /tmp/fbvenv/bin/pip install -c constraints.txt torch==2.13.0 numpy
    /tmp/fbvenv/bin/pip install --no-deps fbgemm-gpu-cpu==1.8.0
    /tmp/fbvenv/bin/python benchmarks/bench_fbgemm_lookups.py \\
        --out benchmarks/results/bench_fbgemm_lookups.json
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

import torch
import torch.nn.functional as F
from field_models import DIM, TABLE_SIZES, Workload
from report import machine, save
from torch import Tensor

POOLING = {"sum": 0, "mean": 1}  # fbgemm_gpu's PoolingMode values


@dataclass
class PulledStep:
    """One batch as a trainer holds it: per table, the sorted unique ids it touches, their
    rows (``[n, DIM]``), the batch's ids as positions in them, the bag offsets, and a weight per
    id (for the per-sample-weight check). ``tables`` are the whole tables the rows come from."""

    tables: list[Tensor]
    unique_ids: list[Tensor]
    rows: list[Tensor]
    local_ids: list[Tensor]
    offsets: list[Tensor]
    sample_weights: list[Tensor]
    batch_size: int


def pulled_steps(batch_size: int, seed: int) -> Iterator[PulledStep]:
    """The ``bags`` workload's batches (trainer 0 of 1), each with its pulled rows."""
    generator = torch.Generator().manual_seed(seed)
    tables = [torch.randn(rows, DIM, generator=generator) * 0.01 for rows in TABLE_SIZES]
    for (_, offsets, ids), _ in Workload("bags", batch_size, 1_000_000).batches(0, 1):
        unique_ids = [torch.unique(i) for i in ids]  # sorted, as a pull returns them
        yield PulledStep(
            tables=tables,
            unique_ids=unique_ids,
            rows=[table[u] for table, u in zip(tables, unique_ids, strict=True)],
            local_ids=[torch.searchsorted(u, i) for u, i in zip(unique_ids, ids, strict=True)],
            offsets=offsets,
            sample_weights=[torch.rand(i.numel(), generator=generator) for i in ids],
            batch_size=batch_size,
        )


@dataclass
class Lookups:
    """One step's lookups and backward: CPU seconds per phase, the pooled outputs side by side
    (``[B, tables * DIM]``), each table's row gradient, and each table's per-sample-weight
    gradient (empty unless weighted)."""

    seconds: dict[str, float]
    pooled: Tensor
    row_grads: list[Tensor]
    sample_weight_grads: list[Tensor]


def grad_of(leaf: Tensor) -> Tensor:
    assert leaf.grad is not None, "the backward reached every leaf"
    return leaf.grad


def torch_lookups(step: PulledStep, grad: Tensor, mode: str, weighted: bool) -> Lookups:
    """``F.embedding_bag`` per table over its pulled rows (each a leaf of its own, as a trainer
    holds them), then the backward of ``grad`` (``[B, tables * DIM]``), each table's slice."""
    leaves = [rows.clone().requires_grad_() for rows in step.rows]
    weights = [w.clone().requires_grad_() for w in step.sample_weights]
    start = time.thread_time()
    pooled = [
        F.embedding_bag(ids, rows, offsets, mode=mode, per_sample_weights=w if weighted else None)
        for ids, rows, offsets, w in zip(step.local_ids, leaves, step.offsets, weights, strict=True)
    ]
    forward_done = time.thread_time()
    torch.autograd.backward(pooled, list(grad.split(DIM, dim=1)))
    backward_done = time.thread_time()
    return Lookups(
        seconds={"forward": forward_done - start, "backward": backward_done - forward_done},
        pooled=torch.cat(pooled, dim=1).detach(),
        row_grads=[grad_of(leaf) for leaf in leaves],
        sample_weight_grads=[grad_of(w) for w in weights] if weighted else [],
    )


def fbgemm_lookups(step: PulledStep, grad: Tensor, mode: str, weighted: bool) -> Lookups:
    """FBGEMM's dense TBE over every table at once, the same contract as
    :func:`torch_lookups`; its row gradients are views of its flat weight's gradient."""
    weights = [w.clone().requires_grad_() for w in step.sample_weights]
    start = time.thread_time()
    row_counts = [rows.shape[0] for rows in step.rows]
    flat = torch.cat([rows.reshape(-1) for rows in step.rows]).requires_grad_()
    sizes = torch.tensor([0, *row_counts])
    table_starts = (sizes[:-1] * DIM).cumsum(0)  # where each table begins in ``flat``
    row_starts = sizes.cumsum(0)  # the tables' first rows: TBE's hash_size_cumsum
    id_counts = torch.tensor([0, *(ids.numel() for ids in step.local_ids)]).cumsum(0)
    indices = torch.cat(step.local_ids)
    offsets = torch.cat(
        [o + s for o, s in zip(step.offsets, id_counts[:-1].tolist(), strict=True)]
        + [id_counts[-1:]]
    )
    per_sample = torch.cat(weights) if weighted else None
    packed = time.thread_time()
    pooled = torch.ops.fbgemm.dense_embedding_codegen_lookup_function(
        dev_weights=flat,
        weights_offsets=table_starts,
        D_offsets=torch.arange(len(row_counts) + 1, dtype=torch.int32) * DIM,
        total_D=len(row_counts) * DIM,
        max_D=DIM,
        hash_size_cumsum=row_starts,
        total_hash_size_bits=max(int(row_starts[-1]), 1).bit_length(),
        indices=indices,
        offsets=offsets,
        pooling_mode=POOLING[mode],
        indice_weights=per_sample,
        feature_requires_grad=None,
        output_dtype=0,  # SparseType.FP32
    )
    forward_done = time.thread_time()
    pooled.backward(grad)
    backward_done = time.thread_time()
    return Lookups(
        seconds={
            "pack": packed - start,
            "forward": forward_done - packed,
            "backward": backward_done - forward_done,
        },
        pooled=pooled.detach(),
        row_grads=[g.view(-1, DIM) for g in grad_of(flat).split([n * DIM for n in row_counts])],
        sample_weight_grads=[grad_of(w) for w in weights] if weighted else [],
    )


def upstream_grad(step: PulledStep, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(step.batch_size, len(step.rows) * DIM, generator=generator)


def sort_alone(step: PulledStep) -> dict[str, float]:
    """The default ``torch.sort`` of every table's ids: what torch's backward does first, and
    the order any lookup that keeps torch's bits has to add in (see :func:`fused_in_order`)."""
    start = time.thread_time()
    for ids in step.local_ids:
        torch.sort(ids)
    return {"sort": time.thread_time() - start}


def time_lookups(batch_size: int, steps: int, warmup: int) -> dict[str, Any]:
    """Median CPU microseconds per phase and per step of each lookup, and their ratios."""
    entries: dict[str, Callable[[PulledStep, Tensor], dict[str, float]]] = {
        "torch": lambda step, grad: torch_lookups(step, grad, "sum", False).seconds,
        "fbgemm": lambda step, grad: fbgemm_lookups(step, grad, "sum", False).seconds,
        "torch_sort_alone": lambda step, _: sort_alone(step),
    }
    names = list(entries)
    phases: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for index, step in enumerate(islice(pulled_steps(batch_size, seed=1), warmup + steps)):
        grad = upstream_grad(step, seed=index)
        for name in names[index % 3 :] + names[: index % 3]:  # each goes first in turn
            times = entries[name](step, grad)
            if index < warmup:
                continue
            times["step"] = sum(times.values())
            for phase, seconds in times.items():
                phases[name].setdefault(phase, []).append(seconds * 1e6)
    us = {
        name: {phase: round(statistics.median(v), 1) for phase, v in by_phase.items()}
        for name, by_phase in phases.items()
    }
    torch_us, fbgemm_us = us["torch"], us["fbgemm"]
    return {
        "us_per_step": us,
        "fbgemm_over_torch": round(fbgemm_us["step"] / torch_us["step"], 3),
        "fbgemm_without_pack_over_torch": round(
            (fbgemm_us["step"] - fbgemm_us["pack"]) / torch_us["step"], 3
        ),
        "forward_fbgemm_over_torch": round(fbgemm_us["forward"] / torch_us["forward"], 3),
        "backward_fbgemm_over_torch": round(fbgemm_us["backward"] / torch_us["backward"], 3),
        "sort_share_of_torch_backward": round(
            us["torch_sort_alone"]["sort"] / torch_us["backward"], 3
        ),
        "ids_per_step": sum(i.numel() for i in step.local_ids),
        "pulled_rows_per_step": sum(r.shape[0] for r in step.rows),
    }


def id_scales(step: PulledStep, table: int, mode: str, weighted: bool) -> Tensor:
    """What each id's pooled gradient is multiplied by on its way into its row: its sample
    weight, ``1 / bag length`` in ``mean``, else 1."""
    ids = step.local_ids[table]
    if weighted:
        return step.sample_weights[table]
    lengths = torch.diff(step.offsets[table], append=torch.tensor([ids.numel()]))
    if mode == "mean":
        return (1.0 / lengths.float()).repeat_interleave(lengths)
    return torch.ones(ids.numel())


def fused_in_order(
    step: PulledStep, grad: Tensor, scales: Tensor, table: int, order: str
) -> Tensor:
    """Table ``table``'s row gradient built from zero by a fused multiply-add per id,
    ``row = fma(scale, pooled_grad, row)``, the ids taken in ``order``: ``occurrence`` (bag by
    bag) or ``torch.sort`` (the default, unstable sort of the ids). Ids that hit the same row
    are added in rounds, the k-th hit of every row in round k. The fma is emulated in float64:
    the float32 product is exact there, and the sum is rounded twice (to float64, then float32),
    which can differ from one rounding only in rare near-ties."""
    ids = step.local_ids[table]
    lengths = torch.diff(step.offsets[table], append=torch.tensor([ids.numel()]))
    bag_of_id = torch.arange(step.batch_size).repeat_interleave(lengths)
    permutation = torch.sort(ids).indices if order == "torch.sort" else torch.arange(ids.numel())
    ordered = ids[permutation]
    sorted_ids, positions = torch.sort(ordered, stable=True)
    first = torch.ones_like(sorted_ids, dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    index = torch.arange(ordered.numel())
    group_start = torch.where(first, index, 0).cummax(0).values
    hit_number = torch.empty_like(ordered)
    hit_number[positions] = index - group_start
    products = (
        scales[permutation].double().unsqueeze(1)
        * grad[:, table * DIM : (table + 1) * DIM][bag_of_id[permutation]].double()
    )
    rows = torch.zeros(step.rows[table].shape)
    for hit in range(int(hit_number.max()) + 1 if ordered.numel() else 0):
        chosen = hit_number == hit
        targets = ordered[chosen]
        rows[targets] = (rows[targets].double() + products[chosen]).float()
    return rows


def max_abs_diff(these: list[Tensor], those: list[Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(these, those, strict=True))


def compare(step: PulledStep, grad: Tensor, mode: str, weighted: bool) -> dict[str, Any]:
    """Where FBGEMM's results differ from torch's on one step, and why: the rows whose
    gradients differ, by how many ids hit them, and for how many tables each lookup's
    gradients are :func:`fused_in_order` in each order."""
    mine = torch_lookups(step, grad, mode, weighted)
    theirs = fbgemm_lookups(step, grad, mode, weighted)
    differing, hits_of_differing, rows_hit_3_plus = 0, [], 0
    orders = ("occurrence", "torch.sort")
    in_order = {name: dict.fromkeys(orders, 0) for name in ("torch", "fbgemm")}
    for t, (my_grads, their_grads) in enumerate(zip(mine.row_grads, theirs.row_grads, strict=True)):
        hits = torch.bincount(step.local_ids[t], minlength=my_grads.shape[0])
        rows_differ = (my_grads != their_grads).any(dim=1)
        differing += int(rows_differ.sum())
        hits_of_differing += hits[rows_differ].tolist()
        rows_hit_3_plus += int((hits >= 3).sum())
        scales = id_scales(step, t, mode, weighted)
        for order in orders:
            reference = fused_in_order(step, grad, scales, t, order)
            in_order["torch"][order] += int(torch.equal(reference, my_grads))
            in_order["fbgemm"][order] += int(torch.equal(reference, their_grads))
    result: dict[str, Any] = {
        "pooled_equal": torch.equal(mine.pooled, theirs.pooled),
        "pooled_max_abs_diff": max_abs_diff([mine.pooled], [theirs.pooled]),
        "row_grads_equal": all(map(torch.equal, mine.row_grads, theirs.row_grads)),
        "row_grads_max_abs_diff": max_abs_diff(mine.row_grads, theirs.row_grads),
        "rows_pulled": sum(r.shape[0] for r in step.rows),
        "rows_hit_3_plus_times": rows_hit_3_plus,
        "rows_differing": differing,
        "fewest_hits_of_a_differing_row": min(hits_of_differing, default=None),
        "tables_whose_grads_are_fma_in_order": in_order,
    }
    if weighted:
        result["sample_weight_grads_equal"] = all(
            map(torch.equal, mine.sample_weight_grads, theirs.sample_weight_grads)
        )
        result["sample_weight_grads_max_abs_diff"] = max_abs_diff(
            mine.sample_weight_grads, theirs.sample_weight_grads
        )
    if mode == "mean":  # which rounding each pooled mean takes
        divided, by_reciprocal = [], []
        for ids, rows, offsets in zip(step.local_ids, step.rows, step.offsets, strict=True):
            sums = F.embedding_bag(ids, rows, offsets, mode="sum")
            lengths = torch.diff(offsets, append=torch.tensor([ids.numel()])).float().unsqueeze(1)
            divided.append(sums / lengths)
            by_reciprocal.append(sums * (1.0 / lengths))
        result["torch_mean_is_sum_divided_by_length"] = torch.equal(
            mine.pooled, torch.cat(divided, dim=1)
        )
        result["fbgemm_mean_is_sum_times_reciprocal"] = torch.equal(
            theirs.pooled, torch.cat(by_reciprocal, dim=1)
        )
    return result


def reference_matches_pulled(step: PulledStep, grad: Tensor) -> bool:
    """Whether torch over the whole tables (one process) gives the pulled rows the gradients
    torch over the pulled rows gives them, bit for bit: the promise FBGEMM would have to keep."""
    pulled_grads = torch_lookups(step, grad, "sum", False).row_grads
    for t, table in enumerate(step.tables):
        whole = table.clone().requires_grad_()
        ids = step.unique_ids[t][step.local_ids[t]]
        F.embedding_bag(ids, whole, step.offsets[t], mode="sum").backward(
            grad[:, t * DIM : (t + 1) * DIM]
        )
        if not torch.equal(grad_of(whole)[step.unique_ids[t]], pulled_grads[t]):
            return False
    return True


def check_bitwise(batch_size: int, steps: int) -> dict[str, Any]:
    cases = {"sum": ("sum", False), "mean": ("mean", False), "sum_weighted": ("sum", True)}
    results: dict[str, Any] = {}
    one_process = True
    for index, step in enumerate(islice(pulled_steps(batch_size, seed=2), steps)):
        grad = upstream_grad(step, seed=100 + index)
        one_process = one_process and reference_matches_pulled(step, grad)
        for case, (mode, weighted) in cases.items():
            results.setdefault(case, []).append(compare(step, grad, mode, weighted))
    return {"torch_over_pulled_equals_one_process": one_process, "per_step": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per batch size")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--check-steps", type=int, default=3, help="steps bitwise-checked")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[128, 2048])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", default="bench_fbgemm_lookups.json")
    args = parser.parse_args()
    try:
        import fbgemm_gpu
    except Exception as error:  # an ImportError, or an OSError from a missing library
        message = f"fbgemm_gpu does not load ({error}); see this script's docstring"
        raise SystemExit(message) from error
    # The op records its own autograd node inside its CPU kernel; torch warns that none is
    # registered at the Autograd key, which does not apply to it.
    warnings.filterwarnings("ignore", message=".*autograd kernel was not registered.*")
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {
        "machine": machine(),
        "fbgemm_gpu": fbgemm_gpu.__version__,
        "workload": "bench_field bags: 10 sum bags, dim 16, 2k-100k rows, 1-10 ids per bag",
        "steps": args.steps,
        "timing": {},
        "bitwise": {},
    }
    for batch_size in args.batch_sizes:
        results["timing"][str(batch_size)] = time_lookups(batch_size, args.steps, args.warmup)
        results["bitwise"][str(batch_size)] = check_bitwise(batch_size, args.check_steps)
    save(results, args.out)


if __name__ == "__main__":
    main()
