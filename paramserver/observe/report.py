"""``paramserver report RUN_DIR``: PNG plots and a markdown summary of a run directory.

Reads the JSON-line records (:mod:`.runlog`) and ``summary.json``; writes, under ``RUN_DIR/report``
unless told otherwise, ``loss.png`` (training loss, and held-out metrics if evaluated),
``throughput.png``, ``bytes.png``, ``servers.png`` (per-server load), ``consistency.png`` (if
checked) and ``report.md``. Needs matplotlib (the ``report`` extra).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paramserver.errors import ConfigError
from paramserver.observe.runlog import SUMMARY_FILE, read_records
from paramserver.observe.summary import what_happened

FIGURE_INCHES = (10.0, 6.0)
DPI = 100  # so every plot is 1000 x 600 pixels
_RECORD_KEYS = {"kind", "step", "wall_time"}  # a record's fields that are not values
TRAINER_STEP = "step (each trainer's own)"

Records = dict[str, list[dict[str, Any]]]


def write_report(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write the plots and ``report.md``; returns the files written."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run directory")
    records = read_records(run_dir)
    if not any(records.values()):
        raise ConfigError(
            f"{run_dir}: no metric records (a run writes them with --run-dir {run_dir})"
        )
    summary = _read_summary(run_dir)
    out_dir = Path(out) if out is not None else run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    written = []
    for name, draw in (
        ("loss.png", _draw_loss),
        ("throughput.png", _draw_throughput),
        ("bytes.png", _draw_bytes),
        ("servers.png", _draw_servers),
        ("consistency.png", _draw_consistency),
    ):
        figure = plt.figure(figsize=FIGURE_INCHES, dpi=DPI)
        try:
            if draw(figure, records):
                figure.savefig(out_dir / name, dpi=DPI)
                written.append(out_dir / name)
        finally:
            plt.close(figure)
    markdown = out_dir / "report.md"
    markdown.write_text(_markdown(run_dir, summary, records, [p.name for p in written]))
    return [*written, markdown]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "paramserver report needs matplotlib: pip install 'paramserver[report]'"
        ) from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _read_summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / SUMMARY_FILE
    if not path.exists():
        return {}
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(summary, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    for key in ("bytes_per_step", "calls", "consistency"):
        if not isinstance(summary.get(key, {}), dict):
            raise ConfigError(f"{path}: {key!r} is not an object")
    call_keys = ("calls", "p50_ms", "p90_ms", "p99_ms", "max_ms", "sent_bytes", "received_bytes")
    for op, stats in summary.get("calls", {}).items():
        if not isinstance(stats, dict) or not all(
            type(stats.get(k)) in (int, float) for k in call_keys
        ):
            raise ConfigError(f"{path}: calls[{op!r}] lacks {', '.join(call_keys)}")
    return summary


def _of_kind(records: Records, kind: str, prefix: str) -> dict[str, list[dict[str, Any]]]:
    """Each process's records of ``kind``, for processes named ``prefix-N``, in rank order."""
    found = {
        name: [r for r in entries if r["kind"] == kind]
        for name, entries in records.items()
        if re.fullmatch(rf"{prefix}-[0-9]+", name)  # not, say, a renamed trainer-old
    }
    ordered = sorted(found, key=lambda name: int(name.rsplit("-", 1)[1]))
    return {name: found[name] for name in ordered if found[name]}


def _series(entries: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in entries if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def _plot_each(
    axes: Any, by_process: dict[str, list[dict[str, Any]]], key: str, label: str = ""
) -> None:
    for name, entries in by_process.items():
        steps, values = _series(entries, key)
        axes.plot(steps, values, label=f"{name}{label}")


def _draw_loss(figure: Any, records: Records) -> bool:
    trained = _of_kind(records, "train", "trainer")
    if not trained:
        return False
    axes = figure.add_subplot(1, 1, 1)
    _plot_each(axes, trained, "loss")
    axes.set(
        xlabel=TRAINER_STEP, ylabel="training loss", title="Training loss and held-out metrics"
    )
    handles, labels = axes.get_legend_handles_labels()
    evaluated = _of_kind(records, "eval", "trainer")
    if evaluated:
        metrics = axes.twinx()
        keys = sorted({k for e in evaluated.values() for r in e for k in r} - _RECORD_KEYS)
        for key in keys:
            _plot_each(metrics, evaluated, key, f" held-out {key}")
        for line in metrics.get_lines():
            line.set_linestyle("--")
            line.set_marker("o")
        metrics.set_ylabel("held-out metric")
        more_handles, more_labels = metrics.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    axes.legend(handles, labels, loc="upper right", fontsize="small")
    return True


def _panel(
    axes: Any,
    by_process: dict[str, list[dict[str, Any]]],
    series: Sequence[tuple[str, str]],
    ylabel: str,
    title: str,
    xlabel: str = TRAINER_STEP,
) -> None:
    """One plot of each process's ``(key, label suffix)`` series, labelled, with a legend."""
    for key, suffix in series:
        _plot_each(axes, by_process, key, suffix)
    axes.set(xlabel=xlabel, ylabel=ylabel, title=title)
    axes.legend(fontsize="small")


def _draw_throughput(figure: Any, records: Records) -> bool:
    trained = _of_kind(records, "train", "trainer")
    if trained:
        series = [("samples_per_s", "")]
        _panel(figure.add_subplot(1, 1, 1), trained, series, "samples/s", "Throughput per trainer")
    return bool(trained)


def _draw_bytes(figure: Any, records: Records) -> bool:
    trained = _of_kind(records, "train", "trainer")
    if trained:
        series = [("push_bytes_per_step", " push"), ("pull_bytes_per_step", " pull")]
        axes = figure.add_subplot(1, 1, 1)
        _panel(axes, trained, series, "bytes per step", "Bytes per step, each direction")
    return bool(trained)


SERVER_PANELS = (
    ("pushes_per_s", "pushes/s"),
    ("rows_updated_per_s", "rows updated/s"),
    ("update_time_share", "share of time updating"),
    ("mean_staleness", "mean staleness (updates)"),
)


def _draw_servers(figure: Any, records: Records) -> bool:
    served = _of_kind(records, "server", "server")
    if not served:
        return False
    for index, (key, title) in enumerate(SERVER_PANELS, start=1):
        axes = figure.add_subplot(2, 2, index)
        _panel(axes, served, [(key, "")], "", title, xlabel="chief's step")
    figure.suptitle("Per-server load")
    figure.tight_layout()
    return True


def _draw_consistency(figure: Any, records: Records) -> bool:
    checked = _of_kind(records, "consistency", "trainer")
    if not checked:
        return False
    behind, apart = figure.add_subplot(2, 1, 1), figure.add_subplot(2, 1, 2)
    title = "Dense replicas against the servers"
    _panel(behind, checked, [("versions_behind_max", "")], "versions behind (max)", title, "")
    _panel(apart, checked, [("rel_l2_diff", "")], "relative L2 distance", "")
    figure.tight_layout()
    return True


def _markdown(run_dir: Path, summary: dict[str, Any], records: Records, images: list[str]) -> str:
    lines = [f"# Run report: {run_dir}", ""]
    if summary:
        rows = _figures(summary)
        lines += ["| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows], ""]
        happened = _what_happened(summary)
        if happened:
            lines += ["## What happened", "", *[f"- {k}: {v}" for k, v in happened], ""]
        calls = summary.get("calls") or {}
        if calls:
            lines += [
                "## Calls by operation (every trainer's)",
                "",
                "| operation | calls | p50 ms | p90 ms | p99 ms | max ms | sent B | received B |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for op, c in calls.items():
                lines.append(
                    f"| {op} | {c['calls']} | {c['p50_ms']:.2f} | {c['p90_ms']:.2f} | "
                    f"{c['p99_ms']:.2f} | {c['max_ms']:.2f} | {c['sent_bytes']:,} | "
                    f"{c['received_bytes']:,} |"
                )
            lines.append("")
        consistency = summary.get("consistency") or {}
        if consistency:
            lines += ["## Replica consistency", ""]
            lines += [f"- {key}: {_number(value)}" for key, value in consistency.items()]
            lines.append("")
    else:
        lines += [f"(no {SUMMARY_FILE}: the run did not finish, or wrote no summary)", ""]
    processes = ", ".join(f"{name} ({len(entries)})" for name, entries in records.items())
    lines += [f"Records per process: {processes}.", ""]
    lines += [f"![{Path(name).stem}]({name})" for name in images]
    return "\n".join(lines) + "\n"


def _figures(summary: dict[str, Any]) -> list[tuple[str, Any]]:
    """The summary's figures as the report's table shows them."""
    per_step = summary.get("bytes_per_step", {})
    rows = [
        ("mode", summary.get("mode")),
        ("servers / trainers", f"{summary.get('servers')} / {summary.get('trainers')}"),
        ("steps (all trainers)", summary.get("steps")),
        ("attempts", len(summary.get("attempts") or []) or 1),
        ("samples", _number(summary.get("samples"))),
        ("samples/s", _number(summary.get("samples_per_s"))),
        ("training loss", _number(summary.get("train_loss"))),
        ("push bytes/step", _number(per_step.get("push"))),
        ("pull bytes/step", _number(per_step.get("pull"))),
        ("wall time (s)", _number(summary.get("wall_s"))),
    ]
    rows += [
        (f"held-out {key.removeprefix('eval_')}", _number(value))
        for key, value in summary.items()
        if key.startswith("eval_") and isinstance(value, int | float)
    ]
    return rows


def _what_happened(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The printed summary's lines on restarts, recovery, departures and a stream; none for
    a summary written before it had the keys they read."""
    try:
        return what_happened(summary)
    except (KeyError, TypeError, IndexError):
        return []


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return "-" if value is None else str(value)
