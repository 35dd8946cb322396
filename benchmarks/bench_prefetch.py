"""What prefetch costs in learning: async with and without it against one process, held-out AUC.

Prefetch sends a step's pull while the step before it computes, so a trainer's rows are read
before its own last update reaches them: one update stale. On a model where a step touches
most rows the last one touched (a small, hot item table read twice per sample) that staleness
shows in what the model learns. The trainer now applies its own last update to the rows it
prefetched (``--prefetch-own-updates``, trainer/ownupdates.py); this measures what is left of
the gap with it, and the gap without it (issue 29's point 5).

The data plant a signal: items have hidden vectors; a sample is a user's history (1-10 items,
Zipf) and a target item; its click is a Bernoulli draw of ``sigmoid(scale * <mean of the
history's vectors, the target's vector>)``, and, for the two-task model, its conversion a draw
that needs the click. The models:

- ``din``: one item table read by the history (``F.embedding_bag`` on its weight, mean) and by
  the target (the layer), an MLP on ``[history, target, history * target]``;
- ``two_task``: the same features, a shared bottom and two heads (click, conversion).

Systems, each in fresh processes (``systems.run_isolated``), Adagrad, the same batches:
``single_process`` (``paramserver.baseline``), ``prefetch`` (own updates applied),
``prefetch_stale`` (without them: the prefetch before) and ``no_prefetch`` (paramserver, 1
server + 1 trainer, async; the MLP's dense parameters on the server, so under prefetch they
stay a step behind either way). Reported: held-out AUC (click), samples/s, the AUC gaps to one
process, and prefetch's samples/s against the other two; repeats alternate the order and
report medians.

    .venv/bin/python benchmarks/bench_prefetch.py --out benchmarks/results/bench_prefetch.json
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from report import machine, save
from systems import run_isolated
from torch import Tensor, nn

import paramserver as ps
from paramserver.baseline import train_single_process
from paramserver.metrics import auc_of_scores

NUM_ITEMS = 2_000
DIM = 8


@dataclass(frozen=True)
class Task:
    model: str  # "din" or "two_task"
    batch_size: int
    steps: int
    seed: int = 0

    def make_model(self) -> nn.Module:
        return DinModel(two_task=self.model == "two_task")

    def batches(self, trainer: int, num_trainers: int) -> Iterator[tuple[Any, Tensor]]:
        for step in range(trainer, self.steps, num_trainers):
            inputs, click, conversion = sample(self.seed * 7_919 + step, self.batch_size)
            yield inputs, torch.stack([click, conversion], 1)

    def held_out(self) -> list[tuple[Any, Tensor]]:
        return [sample((1 << 30) + self.seed * 7_919 + i, 4_096)[:2] for i in range(4)]


_VECTORS = torch.randn(NUM_ITEMS, DIM, generator=torch.Generator().manual_seed(12345))
_POPULARITY = 1.0 / torch.arange(1, NUM_ITEMS + 1, dtype=torch.float64) ** 1.05


def sample(seed: int, size: int) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor, Tensor]:
    """``(history ids, their offsets, target ids)``, clicks and conversions of ``size`` samples."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 11, (size,), generator=g)
    history = torch.multinomial(_POPULARITY, int(lengths.sum()), True, generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    target = torch.multinomial(_POPULARITY, size, True, generator=g)
    taste = F.embedding_bag(history, _VECTORS, offsets, mode="mean")
    logits = 1.5 * (taste * _VECTORS[target]).sum(1)
    click = torch.bernoulli(torch.sigmoid(logits), generator=g)
    conversion = click * torch.bernoulli(torch.sigmoid(logits - 1.0), generator=g)
    return (history, offsets, target), click, conversion


class DinModel(nn.Module):
    def __init__(self, two_task: bool) -> None:
        super().__init__()
        self.item = nn.Embedding(NUM_ITEMS, DIM)
        nn.init.normal_(self.item.weight, std=0.1)
        self.bottom = nn.Sequential(nn.Linear(3 * DIM, 32), nn.ReLU())
        self.heads = nn.Linear(32, 2 if two_task else 1)

    def forward(self, history: Tensor, offsets: Tensor, target: Tensor) -> Tensor:
        seen = F.embedding_bag(history, self.item.weight, offsets, mode="mean")
        wanted = self.item(target)
        return self.heads(self.bottom(torch.cat([seen, wanted, seen * wanted], 1)))


def loss_fn(output: Tensor, labels: Tensor) -> Tensor:
    """Click loss, and the conversion head's where the model has one."""
    losses = F.binary_cross_entropy_with_logits(output, labels[:, : output.shape[1]])
    return losses


def held_out_auc(model: nn.Module, task: Task) -> float:
    model.eval()
    scores, clicks = [], []
    with torch.no_grad():
        for inputs, click in task.held_out():
            scores.append(torch.sigmoid(model(*inputs)[:, 0]))
            clicks.append(click)
    return auc_of_scores(torch.cat(scores), torch.cat(clicks))


def config(**overrides: Any) -> ps.TrainConfig:
    return ps.TrainConfig(
        optimizer="adagrad", lr=0.05, progress=False, threads_per_process=1, **overrides
    )


def single_process(task: Task) -> dict[str, float]:
    torch.set_num_threads(1)
    model, stats = train_single_process(
        task.make_model, task.batches, loss_fn, config(servers=1, trainers=1)
    )
    return {"auc": held_out_auc(model, task), "samples_per_s": stats["samples_per_s"]}


def paramserver(task: Task, prefetch: bool, own_updates: bool = True) -> dict[str, float]:
    torch.set_num_threads(1)
    settings = config(servers=1, trainers=1, prefetch=prefetch, prefetch_own_updates=own_updates)
    result = ps.train(task.make_model, task.batches, loss_fn, settings)
    assert result is not None and result.model is not None
    return {
        "auc": held_out_auc(result.model, task),
        "samples_per_s": result.summary["samples_per_s"],
    }


SYSTEMS = {
    "single_process": lambda task: single_process(task),
    "prefetch": lambda task: paramserver(task, True),
    "prefetch_stale": lambda task: paramserver(task, True, own_updates=False),
    "no_prefetch": lambda task: paramserver(task, False),
}


def run_system(name: str, task: Task) -> dict[str, float]:
    return SYSTEMS[name](task)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=400, help="batches of each run")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs; medians")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few steps")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--out", default="bench_prefetch.json")
    args = parser.parse_args()
    steps, repeats = (20, 1) if args.quick else (args.steps, args.repeats)
    entries: dict[str, Any] = {}
    for model in ("din", "two_task"):
        task = Task(model, args.batch, steps)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in SYSTEMS}
        for repeat in range(repeats):
            order = list(SYSTEMS) if repeat % 2 == 0 else list(SYSTEMS)[::-1]
            for name in order:
                runs[name].append(run_isolated(run_system, [(name, task)], args.timeout)[0])
        medians = {
            name: {key: statistics.median(r[key] for r in each) for key in each[0]}
            for name, each in runs.items()
        }
        one = medians["single_process"]["auc"]
        entries[model] = {
            "runs": runs,
            "median": medians,
            "auc_gap_to_one_process": {
                name: one - medians[name]["auc"]
                for name in ("prefetch", "prefetch_stale", "no_prefetch")
            },
            "prefetch_samples_per_s_vs": {
                name: medians["prefetch"]["samples_per_s"] / medians[name]["samples_per_s"]
                for name in ("prefetch_stale", "no_prefetch", "single_process")
            },
        }
    save(
        {
            "benchmark": "bench_prefetch",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": machine(),
            "steps": steps,
            "batch_size": args.batch,
            "repeats": repeats,
            "entries": entries,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
