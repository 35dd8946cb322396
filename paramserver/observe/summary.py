"""The job summary: what a run did, from every server's statistics and every trainer's report
(``--summary-json``, the result's ``summary``)."""

from __future__ import annotations

import json
import math
from typing import Any

from paramserver.config import TrainConfig
from paramserver.observe import startup
from paramserver.observe.consistency import merge_checks
from paramserver.wire.reports import CallStats, TrainerReport


def summarize(
    server_stats: list[dict[str, Any]],
    chief: TrainerReport,
    evals: list[dict[str, Any]],
    config: TrainConfig,
    wall_s: float,
) -> dict[str, Any]:
    """The job summary (the ``--summary-json`` object) from the statistics the chief gathered
    from every server (``server_stats``), its own report and its evaluations.

    Every figure covers this run, the work done since it started or resumed over the time
    it took (a resumed run's rates are its own, not the whole job's samples over its seconds):
    steps, samples, seconds, bytes, calls, server counters. ``resumed_from`` says where a
    resumed run began. The ``tables`` counters are the exception: they belong to the tables,
    are saved in checkpoints and count from the job's start.
    """
    reports = _trainer_reports(server_stats)
    servers = [{k: v for k, v in s.items() if k not in _JOB_WIDE_STATS} for s in server_stats]
    total_steps = sum(r.steps for r in reports)
    return {
        "mode": config.mode,
        "servers": config.servers,
        "trainers": config.trainers,
        "steps": total_steps,
        "trainer_steps": [r.steps for r in reports],
        **_samples_loss_and_time(reports, wall_s),
        "resumed_from": _resumed_from(chief.resumed_at, reports),
        "bytes": _bytes_moved(reports, servers),
        "bytes_per_step": _bytes_per_step(reports, total_steps),
        # Under the threads launcher every trainer reports the one shared process.
        "peak_rss_mb_per_trainer": [r.peak_rss_bytes / 2**20 for r in reports],
        "startup": startup.startup_seconds(),  # the chief's phases (this is its process)
        "input_bytes": _input_bytes(reports),
        "row_bytes_per_step": sum(r.row_bytes_received for r in reports) / max(total_steps, 1),
        "cache": _cache_figures(config, reports),
        "compression_ratio": _compression_ratios(reports),
        "server_stats": servers,
        "recovery": _recovery(server_stats, reports),
        **_stream(reports),
        "tables": _summed_table_counters(server_stats),
        **_departures(server_stats),
        "staleness": _staleness_histogram(server_stats),
        # Per operation, over every trainer's calls: latency percentiles and bytes.
        "calls": _call_summaries(reports),
        "consistency": merge_checks([r.consistency for r in reports if r.consistency]),
        "eval_history": evals,
        "lr": _learning_rates(chief, config, server_stats),
    }


def _bytes_per_step(reports: list[TrainerReport], total_steps: int) -> dict[str, float]:
    return {
        "push": sum(r.bytes_sent for r in reports) / max(total_steps, 1),
        "pull": sum(r.bytes_received for r in reports) / max(total_steps, 1),
    }


def _stream(reports: list[TrainerReport]) -> dict[str, Any]:
    """A job reading a stream: where each trainer ended, and its records and bad records (from
    the job's start: positions count them)."""
    ends = [json.loads(r.input_position) for r in reports if r.input_position is not None]
    if not ends:
        return {}
    counted = [end for end in ends if isinstance(end, dict)]
    return {
        "stream": {
            "positions": ends,
            "records": sum(int(end.get("records", 0)) for end in counted),
            "bad_records": sum(int(end.get("bad_records", 0)) for end in counted),
        }
    }


def _recovery(server_stats: list[dict[str, Any]], reports: list[TrainerReport]) -> dict[str, Any]:
    """--recover: how each restarted server was rebuilt, and what the trainers sent again."""
    return {
        "servers": [s.get("recovery") for s in server_stats],
        "resent_calls": [r.resent_calls for r in reports],
        "paused_s": [r.paused_s for r in reports],
    }


def _departures(server_stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The trainers that departed and, for each, the longest silence after which a server
    declared it departed."""
    departed = sorted({t for stats in server_stats for t in stats["departed"]})
    return {
        "departed_trainers": departed,
        "departed_after_s": {
            str(t): max(s["departed_after_silence_s"].get(t, 0.0) for s in server_stats)
            for t in departed
        },
    }


def _learning_rates(
    chief: TrainerReport, config: TrainConfig, server_stats: list[dict[str, Any]]
) -> dict[str, float]:
    """Each group's learning rate (``dense``, each table) at the chief's last training step:
    the rate that step's gradients were applied at (step 0's if it made none)."""
    last = max(chief.resumed_steps + chief.steps - 1, 0)
    tables = sorted({name for stats in server_stats for name in stats["tables"]})
    return config.learning_rates.at(last, tables)


# What a server reports about the whole job rather than about itself: summed or merged over the
# servers into keys of their own, left out of each server's entry in ``server_stats``.
_JOB_WIDE_STATS = (
    "reports",
    "left",
    "tables",
    "departed",
    "staleness",
    "departed_after_silence_s",
    "recovery",
)


def _trainer_reports(server_stats: list[dict[str, Any]]) -> list[TrainerReport]:
    """Every trainer's report, in trainer order (each server holds those it received)."""
    reports: dict[int, TrainerReport] = {}
    for stats in server_stats:
        reports.update(stats["reports"])
    return [reports[t] for t in sorted(reports)]


def _samples_loss_and_time(reports: list[TrainerReport], wall_s: float) -> dict[str, Any]:
    train_seconds = max((r.train_seconds for r in reports), default=0.0)
    samples = sum(r.samples for r in reports)
    losses = [r.train_loss for r in reports if not math.isnan(r.train_loss)]
    return {
        "samples": samples,
        "samples_per_s": samples / train_seconds if train_seconds > 0 else 0.0,
        "train_loss": sum(losses) / len(losses) if losses else float("nan"),
        "train_seconds": train_seconds,
        "wall_s": wall_s,
    }


def _resumed_from(checkpoint_step: int, reports: list[TrainerReport]) -> dict[str, Any] | None:
    """Where a resumed run began (None for a run from the start)."""
    if checkpoint_step < 0:
        return None
    return {
        "checkpoint_step": checkpoint_step,
        "trainer_steps": [r.resumed_steps for r in reports],
        "samples": sum(r.resumed_samples for r in reports),
    }


def _bytes_moved(
    reports: list[TrainerReport], servers: list[dict[str, Any]]
) -> dict[str, dict[str, int]]:
    return {
        "trainers": {
            "sent": sum(r.bytes_sent for r in reports),
            "received": sum(r.bytes_received for r in reports),
        },
        "servers": {
            "sent": sum(s["bytes_sent"] for s in servers),
            "received": sum(s["bytes_received"] for s in servers),
        },
    }


def _input_bytes(reports: list[TrainerReport]) -> list[int] | None:
    """Per trainer, the bytes of input it read; None unless every trainer's data counted them."""
    counted = [r.input_bytes for r in reports if r.input_bytes is not None]
    return counted if len(counted) == len(reports) else None


def _cache_figures(config: TrainConfig, reports: list[TrainerReport]) -> dict[str, Any]:
    hits = sum(r.cache_hits for r in reports)
    lookups = sum(r.cache_lookups for r in reports)
    return {
        "rows_per_table": config.cache_rows,
        "lag": config.cache_lag,
        "hit_rate": _ratio(hits, lookups) if config.cache_rows else 0.0,
    }


def _compression_ratios(reports: list[TrainerReport]) -> dict[str, float]:
    """Bytes on the wire over what the same messages would take without codecs."""
    return {
        "push": _ratio(
            sum(r.bytes_sent for r in reports), sum(r.uncompressed_bytes_sent for r in reports)
        ),
        "pull": _ratio(
            sum(r.bytes_received for r in reports),
            sum(r.uncompressed_bytes_received for r in reports),
        ),
    }


def _summed_table_counters(server_stats: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Each table's counters, summed over the servers holding its rows."""
    tables: dict[str, dict[str, int]] = {}
    for stats in server_stats:
        for name, counters in stats["tables"].items():
            total = tables.setdefault(name, {})
            for key, value in counters.items():
                total[key] = total.get(key, 0) + value
    return tables


def _staleness_histogram(server_stats: list[dict[str, Any]]) -> dict[int, int]:
    """How many gradients arrived at each age, over the servers (each measures its own): the
    summary's ``staleness``, the one thing that word names (the SSP bound is ``ssp_bound``)."""
    staleness: dict[int, int] = {}
    for stats in server_stats:
        for age, count in stats["staleness"].items():
            staleness[age] = staleness.get(age, 0) + count
    return dict(sorted(staleness.items()))


def _call_summaries(reports: list[TrainerReport]) -> dict[str, dict[str, Any]]:
    calls: dict[str, CallStats] = {}
    for report in reports:
        for op, stats in report.calls.items():
            calls.setdefault(op, CallStats()).merge(stats)
    return {op: stats.summary() for op, stats in sorted(calls.items())}


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 1.0
