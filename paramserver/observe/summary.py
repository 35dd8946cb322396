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
    are saved in checkpoints and count from the job's start. A launcher that restarted the
    job makes it the whole run's with :func:`cover_attempts`.
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
    # Each trainer's is the mean over its steps: weighted by them, the mean over every step.
    stepped = [r for r in reports if r.steps and not math.isnan(r.train_loss)]
    weight = sum(r.steps for r in stepped)
    return {
        "samples": samples,
        "samples_per_s": samples / train_seconds if train_seconds > 0 else 0.0,
        "train_loss": sum(r.train_loss * r.steps for r in stepped) / weight if weight else None,
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


def cover_attempts(
    summary: dict[str, Any],
    attempts: list[dict[str, Any]],
    restarts: list[dict[str, Any]],
    began: dict[str, Any] | None,
    wall_s: float,
) -> None:
    """Make the summary of a run's finished attempt (``summary``, :func:`summarize`'s) the
    whole run's, where a launcher restarted the job: ``attempts`` as the launcher saw them,
    the ``restarts`` between them, where the run ``began`` (its first attempt's
    ``resumed_from``) and its ``wall_s``.

    ``steps``, ``trainer_steps`` and ``samples`` become what the run trained that its final
    model holds (from where it began to where the finished attempt ended); ``train_seconds``
    adds every attempt's; ``samples_per_s`` divides the two. The figures the processes
    report (``train_loss``, ``bytes``, ``calls``, ``server_stats`` and the rest) stay the
    finished attempt's: a failed attempt's processes report nothing.
    """
    summary.update(attempts=attempts, restarts=restarts, wall_s=wall_s)
    if len(attempts) < 2:
        return
    ended = summary["resumed_from"] or {"trainer_steps": [0] * summary["trainers"], "samples": 0}
    ends = [a + b for a, b in zip(ended["trainer_steps"], summary["trainer_steps"], strict=True)]
    start = began["trainer_steps"] if began is not None else [0] * len(ends)
    if len(start) != len(ends):  # began on another trainer count: its steps shared out
        total, count = sum(start), len(ends)
        start = [total // count + (t < total % count) for t in range(count)]
    summary["trainer_steps"] = [end - first for end, first in zip(ends, start, strict=True)]
    summary["steps"] = sum(summary["trainer_steps"])
    summary["samples"] += ended["samples"] - (began["samples"] if began is not None else 0)
    summary["train_seconds"] = sum(attempt["train_seconds"] for attempt in attempts)
    seconds = summary["train_seconds"]
    summary["samples_per_s"] = summary["samples"] / seconds if seconds > 0 else 0.0
    summary["resumed_from"] = began


def nothing_trained(summary: dict[str, Any]) -> str | None:
    """One line saying that a run trained no step, and why; None where it trained."""
    if summary["steps"]:
        return None
    resumed = summary["resumed_from"]
    if resumed is None:
        return "nothing trained: the data gave no batch"
    done = ", ".join(str(steps) for steps in resumed["trainer_steps"])
    return (
        f"nothing to train: resumed from checkpoint {resumed['checkpoint_step']}, where the "
        f"trainers had done {done} steps, the budget (the data over --epochs passes, and "
        f"--steps) is met; raise --epochs or --steps, or give more data, to train on"
    )


def what_happened(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """What the printed summary says beyond its figures, as (label, text) lines: each attempt
    of a restarted run and each restart, each server restarted alone, trainers that departed
    and a stream's records. Every line restates keys of the summary (the JSON holds them)."""
    lines = _restart_lines(summary) + _server_restart_lines(summary)
    for trainer in summary.get("departed_trainers") or []:
        after = summary.get("departed_after_s", {}).get(str(trainer), 0.0)
        lines.append(("departed", f"trainer{trainer}, silent or stuck for {after:.1f} s"))
    stream = summary.get("stream")
    if stream is not None:
        text = f"{stream['records']:,} records trained on, {stream['bad_records']:,} bad skipped"
        lines.append(("stream", f"{text} (since the job began)"))
    return lines


def _restart_lines(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The attempts of a run the processes launcher restarted and the restarts between them;
    under torchrun, the restarts it made (a rank knows their count alone)."""
    attempts, restarts = summary.get("attempts") or [], summary.get("restarts") or []
    if len(attempts) < 2:
        if not restarts:
            return []
        resumed = restarts[-1]["resumed_from"]
        since = "" if resumed is None else f"; this attempt resumed from checkpoint {resumed}"
        return [("restarts", f"{len(restarts)} by torchrun (its log says why){since}")]
    lines = []
    for number, attempt in enumerate(attempts, 1):
        began = attempt["resumed_from"]
        start = "from the start" if began is None else f"from checkpoint {began}"
        steps = ", ".join(str(s) for s in attempt["trainer_steps"])
        ended = "finished" if attempt["ended"] == "finished" else "failed"
        when = f"{attempt['started_s']:.1f}-{attempt['ended_s']:.1f} s"
        lines.append((f"attempt {number}", f"{when}, {start}, trainer steps {steps}: {ended}"))
    for restart in restarts:
        said = f" ({restart['error']})" if restart["error"] else ""
        began = restart["resumed_from"]
        start = "from the start" if began is None else f"from checkpoint {began}"
        paused = restart["paused_s"]
        pause = "; no step trained since" if paused is None else f"; training paused {paused:.1f} s"
        text = f"{restart['process']} {restart['exit']}{said} at {restart['at_s']:.1f} s"
        lines.append(("restart", f"{text}; the job restarted {start}{pause}"))
    return lines


def _server_restart_lines(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Each server restarted alone under ``--recover`` (the last restart of each with how it
    was rebuilt), and how long the trainers waited for them."""
    restarts = summary.get("server_restarts") or []
    if not restarts:
        return []
    recovery = summary.get("recovery") or {}
    rebuilt = recovery.get("servers") or []
    last = {restart["server"]: index for index, restart in enumerate(restarts)}
    lines = []
    for index, restart in enumerate(restarts):
        server = restart["server"]
        text = f"server{server} {restart['exit']} at {restart['at_s']:.1f} s"
        how = rebuilt[server] if server < len(rebuilt) and last[server] == index else None
        if how:
            base = how["checkpoint_step"]
            base_text = "its initial state" if base is None else f"checkpoint {base}"
            text += (
                f"; rebuilt from {base_text} and {how['segments']} log segments in "
                f"{how['restore_s']:.1f} s"
            )
        lines.append(("server restart", text))
    waited = max(recovery.get("paused_s") or [0.0])
    resent = sum(recovery.get("resent_calls") or [])
    text = f"training paused {waited:.1f} s (the longest wait of a trainer); {resent} calls"
    lines.append(("recovery", f"{text} sent again"))
    return lines
