"""The jobs ``paramserver train`` runs: for each ``--dataset`` (the synthetic click logs,
Criteo-format files, MovieLens 100k), its model, data, loss, held-out evaluation and the
defaults it trains with.

Only the command line uses them; the library's own layers never see the built-in datasets and
models (see ARCHITECTURE.md).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from paramserver.config import TrainConfig
from paramserver.data import movielens
from paramserver.data.criteo import NUM_CATEGORICAL, NUM_DENSE, CriteoFiles
from paramserver.data.synthetic import SyntheticClickLogs, SyntheticSpec
from paramserver.errors import ConfigError
from paramserver.metrics import (
    Evaluation,
    as_summary,
    auc_of_scores,
    binary_metrics,
    regression_metrics,
)
from paramserver.models.dlrm import DLRM
from paramserver.models.rating import RatingModel
from paramserver.types import LossFn


@dataclass
class Job:
    """What ``paramserver train`` trains, on which data, and how it evaluates the result."""

    model_fn: Callable[[], nn.Module]
    data_fn: Callable[[int, int], Iterator[Any]]
    total_steps: int | None  # for the progress bar; None: a stream of unknown length
    evaluation: Evaluation | None  # held-out data: during training and of the final model
    loss_fn: LossFn = F.binary_cross_entropy_with_logits
    # Figures to judge the held-out metrics by (the ground truth's AUC, a trivial predictor's),
    # made when the job's result is reported: not on the way to its start (the ground truth's
    # AUC loads torchmetrics, about half a second).
    make_references: Callable[[], dict[str, float]] = dict

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """The held-out metrics of ``model`` (``eval_*``), with the references."""
        if self.evaluation is None:
            return {}
        return {**as_summary(self.evaluation.score(model)), **self.make_references()}


DEFAULT_BATCH_SIZE = 512


def batch_size(config: TrainConfig) -> int:
    """The samples per batch of the job's data: ``--batch-size``, else 512."""
    return DEFAULT_BATCH_SIZE if config.batch_size is None else config.batch_size


def _synthetic_model(spec: SyntheticSpec) -> Callable[[], DLRM]:
    rows = spec.rows_per_table
    return lambda: DLRM(num_dense=spec.num_dense, table_rows=[rows] * spec.num_tables)


def _criteo_model() -> DLRM:
    return DLRM(num_dense=NUM_DENSE, table_rows=[0] * NUM_CATEGORICAL, dynamic_tables=True)


def _synthetic_spec(args: argparse.Namespace, config: TrainConfig) -> SyntheticSpec:
    return SyntheticSpec(
        rows_per_table=args.rows_per_table,
        batch_size=batch_size(config),
        train_batches=args.train_batches,
        eval_samples=args.eval_samples,
        seed=config.seed,
    )


def synthetic_job(args: argparse.Namespace, config: TrainConfig) -> Job:
    spec = _synthetic_spec(args, config)
    data = SyntheticClickLogs(spec)
    steps_per_trainer = -(-spec.train_batches // config.trainers) * config.epochs
    steps_per_trainer = -(-steps_per_trainer // config.accumulate)
    if config.steps is not None:
        steps_per_trainer = min(steps_per_trainer, config.steps)
    model_fn = _synthetic_model(spec)
    held_out = list(data.eval_batches())
    truth = torch.cat([logits for _, logits in held_out]).sigmoid()
    labels = torch.cat([batch[1] for batch, _ in held_out])
    return Job(
        model_fn,
        data.train_batches,
        steps_per_trainer * config.trainers,
        Evaluation(lambda: [batch for batch, _ in held_out], binary_metrics),
        make_references=lambda: {"eval_auc_ceiling": auc_of_scores(truth, labels)},
    )


def criteo_job(args: argparse.Namespace, config: TrainConfig) -> Job:
    """A DLRM with one dynamic table per categorical column, on Criteo-format files; held out:
    the --eval-data files, or the last --eval-fraction of the --dataset files."""
    paths = [p for p in args.dataset.removeprefix("criteo:").split(",") if p]
    held_out = args.eval_data.split(",") if args.eval_data else []
    for path in paths + held_out:
        if not Path(path).is_file():
            raise ConfigError(f"--dataset/--eval-data: no such file: {path}")
    fraction = args.eval_fraction
    if fraction is not None and not 0.0 < fraction < 1.0:
        raise ConfigError(f"--eval-fraction must be in (0, 1), got {fraction}")
    if held_out and fraction is not None:
        raise ConfigError("--eval-data and --eval-fraction: give one of them")
    model_fn = _criteo_model
    data = CriteoFiles(paths, batch_size=batch_size(config), eval_fraction=fraction or 0.0)
    if held_out:
        files = CriteoFiles(held_out, EVAL_BATCH_SIZE)
        evaluation = Evaluation(lambda: files.train_batches(0, 1), binary_metrics)
        return Job(model_fn, data.train_batches, None, evaluation)
    return Job(model_fn, data.train_batches, None, held_out_part(data))


EVAL_BATCH_SIZE = 8192  # held-out Criteo lines are scored this many at a time


def stream_job(args: argparse.Namespace, config: TrainConfig) -> Job:
    """The Criteo job's model on input that does not end: Criteo lines from a Redis stream
    (``stream:redis://HOST:PORT/STREAM``) or Criteo files arriving in a folder
    (``criteo-follow:DIR``), read until the job is stopped or ``--steps``; held out: the
    --eval-data files."""
    from paramserver.streams import FollowedFolder, RedisStream, RedisWindow

    source: FollowedFolder | RedisStream
    if args.dataset.startswith("criteo-follow:"):
        directory = Path(args.dataset.removeprefix("criteo-follow:"))
        source = FollowedFolder(directory, batch_size(config))
    else:
        url = args.dataset.removeprefix("stream:")
        if not url.startswith("redis://"):
            raise ConfigError(f"--dataset stream:URL reads a Redis stream (redis://...): {url!r}")
        if args.max_bad_records < 0:
            raise ConfigError(f"--max-bad-records must be at least 0, got {args.max_bad_records}")
        source = RedisStream.from_url(
            url, batch_size=batch_size(config), max_bad_records=args.max_bad_records
        )
    source.check()
    evaluation = None
    if args.eval_data and args.eval_data.startswith("stream:"):  # the newest of a stream
        held_out = RedisStream.from_url(
            args.eval_data.removeprefix("stream:"), batch_size=EVAL_BATCH_SIZE
        )
        if args.eval_window < 1:
            raise ConfigError(f"--eval-window must be at least 1, got {args.eval_window}")
        evaluation = Evaluation(RedisWindow(held_out, args.eval_window), binary_metrics)
    elif args.eval_data:
        held_out = args.eval_data.split(",")
        for path in held_out:
            if not Path(path).is_file():
                raise ConfigError(f"--eval-data: no such file: {path}")
        files = CriteoFiles(held_out, EVAL_BATCH_SIZE)
        evaluation = Evaluation(lambda: files.train_batches(0, 1), binary_metrics)
    return Job(_criteo_model, source, config.steps, evaluation)


def held_out_part(data: CriteoFiles) -> Evaluation | None:
    """The evaluation on the held-out part of ``data`` (``--eval-fraction``), if any; a
    ConfigError where the cut leaves one side without lines."""
    if not data.eval_fraction:
        return None
    flag = f"--eval-fraction {data.eval_fraction}"
    gzip_note = "a gzip file is never cut: it goes whole to the side holding its middle byte"
    if not data.eval_splits():
        raise ConfigError(f"{flag} holds out nothing ({gzip_note}); give plain text or more files")
    if not data.splits(0, 1):
        raise ConfigError(f"{flag} leaves nothing to train on ({gzip_note})")
    scored = dataclasses.replace(data, batch_size=EVAL_BATCH_SIZE)
    return Evaluation(scored.eval_batches, binary_metrics)


MOVIELENS_DEFAULTS: dict[str, Any] = {
    "epochs": 4,
    "batch_size": 512,
    "optimizer": "adagrad",
    "lr": 0.05,
    "prefetch": False,
}
"""What the movielens job trains with where neither a flag nor ``--config`` says otherwise. The
held-out RMSE bottoms out after about 4 epochs (the model then starts to overfit). Without
prefetch: with 943 users, a batch of 512 touches most of the rows the trainer's previous batch
updated. A prefetched pull misses that update (held-out RMSE 0.920-0.926 against 0.910-0.913
without prefetch, at the same speed); with ``--prefetch-own-updates`` it learns as well
(0.907-0.914) but about 20% slower, since nearly every row's state travels and is stepped twice
(2 servers + 2 trainers, 3 runs each, 2026-12-03)."""
DATASET_DEFAULTS = {"movielens": MOVIELENS_DEFAULTS}


def movielens_job(args: argparse.Namespace, config: TrainConfig) -> Job:
    """A rating model (matrix factorization with side features, plus an MLP) on MovieLens 100k,
    trained on the squared error and evaluated by held-out RMSE and MAE."""
    directory = args.dataset.removeprefix("movielens").removeprefix(":") or None
    data = movielens.MovieLensRatings(
        movielens.load_movielens(directory), batch_size=batch_size(config), seed=config.seed
    )
    table_rows, mean_rating = data.data.table_rows(), data.mean_rating
    held_out = torch.cat([rating for _, rating in data.eval_batches()])
    mean_predictor = regression_metrics(torch.full_like(held_out, mean_rating), held_out)

    def model_fn() -> RatingModel:
        return RatingModel(table_rows, movielens.NUM_DENSE, mean_rating=mean_rating)

    steps = [
        -(-batches * config.epochs // config.accumulate)
        for batches in data.num_train_batches(config.trainers)
    ]
    if config.steps is not None:
        steps = [min(s, config.steps) for s in steps]
    return Job(
        model_fn,
        data.train_batches,
        sum(steps),
        Evaluation(data.eval_batches, regression_metrics),
        F.mse_loss,
        lambda: {"eval_rmse_mean_predictor": mean_predictor["rmse"]},
    )


def served_job(
    args: argparse.Namespace, config: TrainConfig
) -> tuple[Callable[[], nn.Module], list[Tensor]]:
    """What serving needs of the job: its model and two samples of its inputs (their names,
    types and shapes), without its training data where the model does not depend on it
    (synthetic and Criteo: served where the data is not)."""
    if args.dataset == "synthetic":
        spec = _synthetic_spec(args, config)
        tables = torch.zeros(2, spec.num_tables, dtype=torch.int64)
        return _synthetic_model(spec), [torch.zeros(2, spec.num_dense), tables]
    if args.dataset.startswith(("criteo:", "stream:", "criteo-follow:")):
        sparse = torch.zeros(2, NUM_CATEGORICAL, dtype=torch.int64)
        return _criteo_model, [torch.zeros(2, NUM_DENSE), sparse]
    job = build_job(args, config)  # MovieLens: its tables are as large as its data says
    inputs, _ = next(iter(job.data_fn(0, 1)))
    return job.model_fn, [t[:2] for t in inputs]


def build_job(args: argparse.Namespace, config: TrainConfig) -> Job:
    """A fresh job for ``--dataset`` (its data iterators start from the first epoch)."""
    if args.eval_fraction is not None and not args.dataset.startswith("criteo:"):
        raise ConfigError("--eval-fraction holds out part of criteo:PATH files, only")
    if args.dataset == "synthetic":
        return synthetic_job(args, config)
    if args.dataset.startswith("criteo:"):
        return criteo_job(args, config)
    if args.dataset.startswith(("stream:", "criteo-follow:")):
        return stream_job(args, config)
    if args.dataset.partition(":")[0] == "movielens":
        return movielens_job(args, config)
    raise ConfigError(
        f"--dataset: unknown dataset {args.dataset!r}; synthetic, criteo:PATH, "
        f"stream:redis://HOST:PORT/STREAM, criteo-follow:DIR or movielens[:DIR]"
    )
