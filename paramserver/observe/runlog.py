"""A run directory's metric records.

Each process that records writes JSON lines to ``RUN_DIR/metrics/NAME.jsonl`` (one object per
record: ``kind``, ``step``, ``wall_time`` and the values) and, when the ``tensorboard`` package
is installed, the same values as TensorBoard scalars under ``RUN_DIR/tensorboard/NAME`` (tag
``KIND/VALUE``), so ``tensorboard --logdir RUN_DIR/tensorboard`` shows every process side by
side. ``paramserver report RUN_DIR`` reads the JSON lines.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from paramserver.errors import ConfigError

log = logging.getLogger(__name__)

METRICS = "metrics"
TENSORBOARD = "tensorboard"
SUMMARY_FILE = "summary.json"
_warned_no_tensorboard = False


class RunLog:
    def __init__(
        self, run_dir: str | Path, name: str, tensorboard: bool = True, resumed_at: int = 0
    ):
        """``resumed_at``: the step a resumed run continues from; TensorBoard drops what the
        earlier run logged after it (the JSON lines keep it: :func:`read_records` drops it)."""
        metrics = Path(run_dir) / METRICS
        metrics.mkdir(parents=True, exist_ok=True)
        self._lines = (metrics / f"{name}.jsonl").open("a", encoding="utf-8")
        self._board: Any = (
            _summary_writer(Path(run_dir) / TENSORBOARD / name, resumed_at) if tensorboard else None
        )

    def write(self, kind: str, step: int, values: dict[str, float]) -> None:
        """One record; non-finite values are written as null (JSON has no NaN)."""
        clean = {k: (float(v) if math.isfinite(v) else None) for k, v in values.items()}
        record = {"kind": kind, "step": step, "wall_time": time.time(), **clean}
        self._lines.write(json.dumps(record) + "\n")
        self._lines.flush()  # a run killed midway keeps what it recorded
        if self._board is not None:
            for key, value in clean.items():
                if value is not None:
                    self._board.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        self._lines.close()
        if self._board is not None:
            self._board.close()
            self._board = None


def _summary_writer(directory: Path, resumed_at: int) -> Any:
    global _warned_no_tensorboard
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # the optional extra is missing: JSON lines only
        if not _warned_no_tensorboard:
            _warned_no_tensorboard = True
            log.warning(
                "tensorboard is not installed (pip install 'paramserver[tensorboard]'): "
                "writing the run's metrics as JSON lines only"
            )
        return None
    # Steps up to resumed_at were done before the checkpoint: keep them.
    return SummaryWriter(
        str(directory), flush_secs=10, purge_step=resumed_at + 1 if resumed_at else None
    )


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> Path:
    """The job summary as ``RUN_DIR/summary.json`` (written whole, then renamed into place)."""
    path = Path(run_dir) / SUMMARY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(summary, indent=2) + "\n")
    partial.replace(path)
    return path


def read_records(run_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Every process's records in ``run_dir``, by process name (``trainer-0``, ``server-1``).

    A torn last line (a process killed while writing) is skipped; any other malformed line is
    a ConfigError naming the file and line. A run that restarted from a checkpoint writes
    steps again: the records it replaced (of a kind, from the step it resumed at) are dropped.
    """
    records: dict[str, list[dict[str, Any]]] = {}
    for path in sorted((Path(run_dir) / METRICS).glob("*.jsonl")):
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"{path}: cannot read ({error})") from None
        entries: list[dict[str, Any]] = []
        latest: dict[str, int] = {}  # the last step of each kind
        for number, line in enumerate(lines, start=1):
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):
                    continue
                raise ConfigError(f"{path}:{number}: not a JSON object") from None
            problem = _problem_with(entry)
            if problem:
                raise ConfigError(f"{path}:{number}: {problem}")
            kind, step = entry["kind"], entry["step"]
            if step < latest.get(kind, step):  # restarted: drop what the restart replaced
                entries = [e for e in entries if e["kind"] != kind or e["step"] < step]
            latest[kind] = step
            entries.append(entry)
        records[path.stem] = entries
    return records


def _problem_with(entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return "not a JSON object"
    if not isinstance(entry.get("kind"), str) or type(entry.get("step")) is not int:
        return "a record needs a string 'kind' and an integer 'step'"
    for key, value in entry.items():
        if key != "kind" and value is not None and type(value) not in (int, float):
            return f"{key!r} is not a number"
    return None
