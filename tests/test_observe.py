"""Observability: call profiles, run-directory records, TensorBoard, held-out evaluation during
training, the replica consistency check, profiler traces and ``paramserver report``."""

from __future__ import annotations

import json
import math
import random
import re
import struct
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.futures import Future

import paramserver as ps
from paramserver.cli import main
from paramserver.errors import ConfigError, ParamServerError
from paramserver.futures import failed
from paramserver.launch.roles import build_server
from paramserver.launch.torchrun import group_restarts
from paramserver.metrics import Evaluation, regression_metrics
from paramserver.modelplan import initial_model
from paramserver.observe import runlog
from paramserver.observe.report import write_report
from paramserver.observe.runlog import RunLog, read_records
from paramserver.observe.summary import cover_attempts, what_happened
from paramserver.transport.base import Transport
from paramserver.transport.local import LocalTransport
from paramserver.transport.profiled import ProfiledTransport
from paramserver.wire.messages import PushPullRequest
from paramserver.wire.reports import NUM_BUCKETS, CallStats, TrainerReport
from tests.helpers import TinyRecModel, mse, tiny_batches

pytestmark = pytest.mark.timeout(120)

STEPS = 20


def tiny_job(run_dir: Path | None = None, evaluation: Evaluation | None = None, **overrides: Any):
    values: dict[str, Any] = {
        "launcher": "threads",
        "servers": 2,
        "trainers": 2,
        "optimizer": "sgd",
        "lr": 0.05,
        "progress": False,
        "run_dir": str(run_dir) if run_dir else None,
        **overrides,
    }
    result = ps.train(
        TinyRecModel,
        lambda t, n: tiny_batches(t, num_batches=STEPS),
        mse,
        ps.TrainConfig(**values),
        evaluation=evaluation,
    )
    assert result is not None and result.model is not None
    return result


def held_out() -> Evaluation:
    return Evaluation(lambda: list(tiny_batches(7, num_batches=3, seed=5)), regression_metrics)


# ---- call profiles ----


def test_percentiles_from_the_histogram_are_within_eight_percent() -> None:
    rng = random.Random(0)
    latencies = [math.exp(rng.uniform(math.log(1e-4), math.log(2.0))) for _ in range(5000)]
    stats = CallStats()
    for seconds in latencies:
        stats.add(seconds)
    ordered = sorted(latencies)
    for q in (50, 90, 99):
        true = ordered[math.ceil(q / 100 * len(ordered)) - 1]
        assert abs(stats.percentile(q) - true) / true < 0.08, q
    assert stats.max_s == max(latencies)
    assert CallStats().percentile(50) == 0.0


def test_merged_profiles_equal_one_profile_of_all_calls() -> None:
    first, second, both = CallStats(), CallStats(), CallStats()
    for i, seconds in enumerate([0.001, 0.01, 0.2, 0.003, 3.0, 0.00001]):
        (first if i % 2 else second).add(seconds)
        both.add(seconds)
    first.merge(second)
    assert first.histogram == both.histogram
    assert (first.calls, first.max_s) == (both.calls, both.max_s)


@pytest.mark.parametrize(
    "broken",
    [
        {"histogram": [0] * (NUM_BUCKETS - 1)},
        {"histogram": [-1] + [0] * (NUM_BUCKETS - 1)},
        {"calls": -1},
        {"max_s": float("nan")},
        {"sent_bytes": 1.5},
    ],
)
def test_a_report_with_a_malformed_call_profile_is_refused(broken: dict[str, Any]) -> None:
    stats = CallStats(**{**vars(CallStats()), **broken})
    report = TrainerReport(0, 1, 1, 0.5, 1.0, 0, 0, calls={"push_pull": stats})
    assert not report.is_well_formed()
    assert TrainerReport(0, 1, 1, 0.5, 1.0, 0, 0, calls={"push_pull": CallStats()}).is_well_formed()
    assert not TrainerReport(0, 1, 1, 0.5, 1.0, 0, 0, consistency={"x": "y"}).is_well_formed()  # type: ignore[dict-item]


class FailingTransport(Transport):
    num_servers = 1

    def call(self, server: int, op: str, *args: Any, timeout_s: float | None = None) -> Any:
        return failed(ConfigError("refused"))


class DeepAnswerTransport(Transport):
    """Answers every call with a list nested past Python's recursion limit (a peer may)."""

    num_servers = 1

    def call(self, server: int, op: str, *args: Any, timeout_s: float | None = None) -> Any:
        deep: list[Any] = []
        for _ in range(100_000):
            deep = [deep]
        answered: Future = Future()
        answered.set_result(deep)
        return answered


@pytest.mark.timeout(30, method="thread")  # before the fix, the wait never ended
def test_an_answer_that_cannot_be_measured_fails_its_call_not_hangs_it() -> None:
    profiled = ProfiledTransport(DeepAnswerTransport())
    with pytest.raises(ParamServerError, match="server 0 sent a malformed answer to pull"):
        profiled.call(0, "pull", 1).wait()
    assert profiled.profile.ops["pull"].calls == 1


def test_profiled_transport_counts_each_operation_and_keeps_error_types() -> None:
    result = tiny_job(steps=3)  # builds servers we can call directly
    assert result.summary["calls"]["push_pull"]["calls"] == 2 * 2 * (3 + 1)  # + the first pull
    endpoints = [build_server(s, ps.TrainConfig(servers=1), TinyRecModel) for s in range(1)]
    profiled = ProfiledTransport(LocalTransport(endpoints))
    request = PushPullRequest(0, 0, pull_rows={"user.weight": torch.tensor([1, 2, 3])})
    reply = profiled.call(0, "pull", request).wait()
    profiled.call(0, "fingerprint").wait()
    pull = profiled.profile.ops["pull"]
    assert pull.calls == 1 and pull.sent_bytes == 3 * 8
    assert pull.received_bytes > 0 and reply.rows["user.weight"].shape == (3, 4)
    assert profiled.profile.ops["fingerprint"].calls == 1
    failing = ProfiledTransport(FailingTransport())
    with pytest.raises(ConfigError, match="refused"):
        failing.call(0, "heartbeat", 0, 0.0).wait()
    assert failing.profile.ops["heartbeat"].calls == 1


# ---- the run directory ----


def test_a_run_directory_holds_records_tensorboard_events_a_trace_and_the_summary(
    tmp_path: Path,
) -> None:
    result = tiny_job(
        tmp_path,
        held_out(),
        metrics_every=5,
        eval_every=10,
        consistency_every=4,
        profile_steps=2,
        profile_start=3,
    )
    records = read_records(tmp_path)
    assert set(records) == {"trainer-0", "trainer-1", "server-0", "server-1"}
    train = [r for r in records["trainer-0"] if r["kind"] == "train"]
    assert [r["step"] for r in train] == [5, 10, 15, 20]
    assert all(r["samples_per_s"] > 0 and r["push_bytes_per_step"] > 0 for r in train)
    # Only the chief evaluates, every 10 steps; then train() evaluates the final model.
    evals = [r for r in records["trainer-0"] if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [10, 20, 20]
    assert not [r for r in records["trainer-1"] if r["kind"] == "eval"]
    assert [e["step"] for e in result.summary["eval_history"]] == [10, 20, 20]
    final = ps.metrics.evaluate(result.model, held_out().data_fn(), regression_metrics)
    assert evals[-1]["rmse"] == pytest.approx(final["rmse"]) == result.summary["eval_rmse"]
    checks = [r for r in records["trainer-1"] if r["kind"] == "consistency"]
    assert [r["step"] for r in checks] == [4, 8, 12, 16, 20]
    assert result.summary["consistency"]["checks"] == 10
    servers = [r for r in records["server-0"] if r["kind"] == "server"]
    assert servers and sum(r["pushes_per_s"] for r in servers) > 0
    trace = json.loads((tmp_path / "profile" / "trainer-0.json").read_text())
    assert trace["traceEvents"]  # one trace: the threads launcher shares one profiler
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 2 * STEPS

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tmp_path / "tensorboard" / "trainer-0"))
    board.Reload()
    assert [e.step for e in board.Scalars("train/loss")] == [5, 10, 15, 20]
    assert [e.step for e in board.Scalars("eval/rmse")] == [10, 20, 20]


def test_without_tensorboard_the_records_are_still_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    monkeypatch.setattr(runlog, "_warned_no_tensorboard", False)
    log = RunLog(tmp_path, "trainer-0")
    log.write("train", 1, {"loss": 0.5, "samples_per_s": float("nan")})
    log.close()
    assert not (tmp_path / "tensorboard").exists()
    [record] = read_records(tmp_path)["trainer-0"]
    assert record["loss"] == 0.5 and record["samples_per_s"] is None


def test_evaluating_without_held_out_data_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="held-out data"):
        tiny_job(eval_every=5)
    train = tmp_path / "train.txt"
    train.write_text("")
    assert main(["train", "--dataset", f"criteo:{train}", "--eval-every", "5"]) == 2
    assert "--eval-data" in capsys.readouterr().err


def test_a_failed_job_leaves_no_log_or_profiler_open(tmp_path: Path) -> None:
    def failing_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    with pytest.raises(ps.JobFailedError, match="boom"):
        ps.train(
            TinyRecModel,
            lambda t, n: tiny_batches(t, num_batches=STEPS),
            failing_loss,
            ps.TrainConfig(
                launcher="threads", progress=False, run_dir=str(tmp_path), profile_steps=2,
                profile_start=0,
            ),
        )  # fmt: skip
    writers = [t for t in threading.enumerate() if type(t).__name__ == "_AsyncWriterThread"]
    assert not writers  # every TensorBoard writer was closed


def test_evaluation_and_checks_do_not_change_what_is_trained() -> None:
    plain = tiny_job(mode="sync").model
    observed = tiny_job(mode="sync", evaluation=held_out(), eval_every=3, consistency_every=2).model
    assert plain is not None and observed is not None
    for (name, a), (_, b) in zip(
        plain.state_dict().items(), observed.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_held_out_metrics_during_training_match_the_final_model() -> None:
    """In sync mode the chief's last evaluation sees every update but its own last step's:
    close to the final model's metrics (train() scores it too), better than the untrained."""
    evaluation = held_out()
    result = tiny_job(mode="sync", evaluation=evaluation, eval_every=STEPS)
    during, final = result.summary["eval_history"]
    assert during["step"] == final["step"] == STEPS
    untrained = ps.metrics.evaluate(
        initial_model(TinyRecModel, 0), evaluation.data_fn(), regression_metrics
    )
    assert during["rmse"] < untrained["rmse"]
    assert during["rmse"] == pytest.approx(final["rmse"], rel=0.05)
    assert final["rmse"] == result.summary["eval_rmse"]


def test_evaluation_alone_scores_the_final_model() -> None:
    result = tiny_job(evaluation=held_out())
    [final] = result.summary["eval_history"]
    assert final == {
        "step": STEPS,
        "rmse": result.summary["eval_rmse"],
        "mae": pytest.approx(result.summary["eval_mae"]),
    }


# ---- the consistency check ----


def test_consistency_in_sync_mode_matches_exactly_at_the_same_version(tmp_path: Path) -> None:
    result = tiny_job(tmp_path, mode="sync", consistency_every=1)
    summary = result.summary["consistency"]
    assert summary["checks"] == 2 * STEPS
    assert summary["differing_at_same_version"] == 0
    assert summary["versions_behind_max"] <= 1  # its own push may have closed the round
    checks = [r for e in read_records(tmp_path).values() for r in e if r["kind"] == "consistency"]
    current = [r for r in checks if r["versions_behind_max"] == 0]
    assert current and all(r["max_abs_diff"] == 0 for r in current)
    assert any(r["max_abs_diff"] > 0 for r in checks if r["versions_behind_max"] > 0)


def test_consistency_shows_prefetch_staleness_and_codec_rounding(tmp_path: Path) -> None:
    prefetching = tiny_job(mode="async", consistency_every=1).summary["consistency"]
    assert prefetching["versions_behind_max"] >= 1
    rounded = tiny_job(tmp_path, mode="sync", consistency_every=1, dense_pull_codec="fp16")
    assert rounded.summary["consistency"]["differing_at_same_version"] > 0
    checks = [r for e in read_records(tmp_path).values() for r in e if r["kind"] == "consistency"]
    current = [r["max_abs_diff"] for r in checks if r["versions_behind_max"] == 0]
    assert current and 0 < max(current) < 1e-2  # fp16 rounding of values of order 1


def test_servers_refuse_malformed_consistency_checks() -> None:
    endpoint = build_server(0, ps.TrainConfig(servers=1), TinyRecModel)
    for bad in ({"mlp.0.weight": 3}, {"no.such.param": "ab"}, {1: "ab"}):
        with pytest.raises(ParamServerError):
            endpoint.handle("dense_check", (bad,)).wait()
    with pytest.raises(ParamServerError, match="bad arguments"):
        endpoint.handle("dense_check", ([],)).wait()
    views = endpoint.handle("dense_check", ({"mlp.0.weight": "0"},)).wait()
    assert views["mlp.0.weight"].version == 0 and views["mlp.0.weight"].value is not None


# ---- the summary: its training loss, a restarted run's attempts ----


def test_train_loss_is_the_mean_over_every_step_of_the_run() -> None:
    """Not over the newest 100 steps a trainer keeps for its progress: over all 150, and a
    trainer's steps weigh as many as they are (here 150 and 40)."""
    losses: dict[int, list[float]] = {0: [], 1: []}
    config = ps.TrainConfig(
        launcher="threads", servers=1, trainers=2, optimizer="sgd", lr=0.05, progress=False
    )
    result = ps.train(
        TinyRecModel,
        lambda t, n: tiny_batches(t, num_batches=150 if t == 0 else 40),
        mse,
        config,
        on_progress=lambda p: losses[p.trainer].append(p.loss),
    )
    assert result is not None and result.summary["trainer_steps"] == [150, 40]
    every = losses[0] + losses[1]
    assert result.summary["train_loss"] == pytest.approx(sum(every) / len(every), rel=1e-9)
    newest = losses[0][-100:] + losses[1][-100:]
    assert abs(sum(newest) / len(newest) - sum(every) / len(every)) > 1e-3  # it can tell


def finished_attempt() -> dict[str, Any]:
    """A summary as the finished attempt of a run restarted once writes it: resumed from
    checkpoint 8 (8 steps each), 4 more steps each, in 2.0 s."""
    return {
        "trainers": 2, "steps": 8, "trainer_steps": [4, 4], "samples": 48,
        "train_seconds": 2.0, "samples_per_s": 24.0, "wall_s": 3.0, "train_loss": 0.5,
        "resumed_from": {"checkpoint_step": 8, "trainer_steps": [8, 8], "samples": 96},
    }  # fmt: skip


ATTEMPTS = [
    {"started_s": 0.0, "ended_s": 5.0, "resumed_from": None, "trainer_steps": [10, 9],
     "train_seconds": 3.0, "ended": "trainer0 (pid 7) exited with status 1: OSError: disk"},
    {"started_s": 5.5, "ended_s": 9.0, "resumed_from": 8, "trainer_steps": [4, 4],
     "train_seconds": 2.0, "ended": "finished"},
]  # fmt: skip
RESTARTS = [
    {"process": "trainer0", "exit": "exited with status 1", "error": "OSError: disk",
     "at_s": 5.0, "resumed_from": 8, "paused_s": 1.5},
]  # fmt: skip


def test_a_restarted_runs_summary_counts_what_its_attempts_trained() -> None:
    summary = finished_attempt()
    cover_attempts(summary, ATTEMPTS, RESTARTS, None, 9.25)
    assert summary["trainer_steps"] == [12, 12] and summary["steps"] == 24
    assert summary["samples"] == 144 and summary["resumed_from"] is None
    assert summary["train_seconds"] == 5.0 and summary["samples_per_s"] == 144 / 5.0
    assert (summary["wall_s"], summary["attempts"], summary["restarts"]) == (
        9.25,
        ATTEMPTS,
        RESTARTS,
    )
    # A run that began with --resume from checkpoint 4, on one trainer more than now.
    summary = finished_attempt()
    began = {"checkpoint_step": 4, "trainer_steps": [4, 4, 3], "samples": 66}
    cover_attempts(summary, ATTEMPTS, RESTARTS, began, 9.25)
    assert summary["trainer_steps"] == [6, 7] and summary["steps"] == 13  # 11 shared out
    assert summary["samples"] == 144 - 66 and summary["resumed_from"] == began
    # One attempt: the summary is already the run's.
    summary = finished_attempt()
    cover_attempts(summary, ATTEMPTS[1:], [], None, 3.5)
    assert summary["steps"] == 8 and summary["wall_s"] == 3.5


def test_the_printed_summary_and_the_report_say_what_happened(tmp_path: Path) -> None:
    summary = {**finished_attempt(), "attempts": ATTEMPTS, "restarts": RESTARTS}
    summary["server_restarts"] = [
        {"server": 1, "exit": "was killed by SIGKILL", "at_s": 7.0, "generation": 1}
    ]
    summary["recovery"] = {
        "servers": [None, {"checkpoint_step": 8, "segments": 3, "damaged_segment": None,
                           "restore_s": 0.25}],
        "resent_calls": [2, 1], "paused_s": [0.5, 0.75],
    }  # fmt: skip
    summary["stream"] = {"positions": [], "records": 1200, "bad_records": 3}
    lines = dict(what_happened(summary))
    assert lines["attempt 1"] == "0.0-5.0 s, from the start, trainer steps 10, 9: failed"
    assert lines["attempt 2"] == "5.5-9.0 s, from checkpoint 8, trainer steps 4, 4: finished"
    assert lines["restart"] == (
        "trainer0 exited with status 1 (OSError: disk) at 5.0 s; the job restarted from "
        "checkpoint 8; training paused 1.5 s"
    )
    assert lines["server restart"] == (
        "server1 was killed by SIGKILL at 7.0 s; rebuilt from checkpoint 8 and 3 log "
        "segments in 0.2 s"
    )
    assert lines["recovery"].startswith("training paused 0.8 s (the longest wait of a trainer)")
    assert lines["recovery"].endswith("; 3 calls sent again")
    assert lines["stream"] == "1,200 records trained on, 3 bad skipped (since the job began)"
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "trainer-0.jsonl").write_text('{"kind": "train", "step": 1}\n')
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    write_report(tmp_path)
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "## What happened" in markdown and "| attempts | 2 |" in markdown
    for label, text in lines.items():
        assert f"- {label}: {text}" in markdown


def test_under_torchrun_the_summary_counts_the_groups_restarts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    restarts = group_restarts({"resumed_from": {"checkpoint_step": 40}})
    assert len(restarts) == 2 and restarts[-1]["resumed_from"] == 40
    assert dict(what_happened({"restarts": restarts}))["restarts"] == (
        "2 by torchrun (its log says why); this attempt resumed from checkpoint 40"
    )
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert group_restarts({"resumed_from": None}) == []


# ---- paramserver report ----


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.system
@pytest.mark.timeout(180)
def test_cli_run_with_a_run_directory_and_its_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    code = main(
        [
            "train", "--train-batches", "120", "--rows-per-table", "2000", "--eval-samples",
            "2000", "--batch-size", "128", "--no-progress", "--run-dir", str(run_dir),
            "--metrics-every", "10", "--eval-every", "30", "--consistency-every", "20",
        ]
    )  # fmt: skip
    assert code == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "eval_auc" in summary and summary["eval_history"]  # the final evaluation too
    assert main(["report", str(run_dir)]) == 0
    report = run_dir / "report"
    import matplotlib.image

    for name in ("loss", "throughput", "bytes", "servers", "consistency"):
        path = report / f"{name}.png"
        assert png_size(path) == (1000, 600), name
        pixels = matplotlib.image.imread(path)
        assert pixels.shape[:2] == (600, 1000)
        assert pixels.std() > 0.01, name  # something was drawn
    markdown = (report / "report.md").read_text()
    assert "| push_pull |" in markdown and "held-out auc" in markdown
    assert "![servers](servers.png)" in markdown
    capsys.readouterr()
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no such run directory" in capsys.readouterr().err


def test_records_of_a_restarted_run_replace_what_the_restart_redid(tmp_path: Path) -> None:
    log = RunLog(tmp_path, "trainer-0", tensorboard=False)
    for step in (10, 20, 30, 20, 30, 40):  # killed after 30, resumed from a checkpoint at 10
        log.write("train", step, {"loss": float(step)})
    log.write("eval", 15, {"auc": 0.5})
    log.close()
    RunLog(tmp_path, "trainer-old", tensorboard=False).close()  # not a process: ignored
    records = read_records(tmp_path)["trainer-0"]
    assert [(r["kind"], r["step"]) for r in records] == [
        ("train", 10), ("train", 20), ("train", 30), ("train", 40), ("eval", 15)
    ]  # fmt: skip
    assert write_report(tmp_path)[0].name == "loss.png"


def test_tensorboard_drops_what_a_resumed_run_rewrites(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = RunLog(tmp_path, "trainer-0")
    for step in (10, 20, 30):
        first.write("train", step, {"loss": 1.0})
    first.close()
    resumed = RunLog(tmp_path, "trainer-0", resumed_at=20)  # from a checkpoint at step 20
    for step in (30, 40):
        resumed.write("train", step, {"loss": 2.0})
    resumed.close()
    board = EventAccumulator(str(tmp_path / "tensorboard" / "trainer-0"))
    board.Reload()
    assert [(e.step, e.value) for e in board.Scalars("train/loss")] == [
        (10, 1.0), (20, 1.0), (30, 2.0), (40, 2.0)
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "content", "problem"),
    [
        ("metrics/trainer-0.jsonl", '{"kind": "train", "step": 1}\n[1]\n{"kind": "x", "step": 2}',
         "trainer-0.jsonl:2: not a JSON object"),
        ("metrics/trainer-0.jsonl", '{"kind": "train", "step": "1"}\n',
         "integer 'step'"),
        ("metrics/trainer-0.jsonl", '{"kind": "train", "step": 1, "loss": "low"}\n',
         "'loss' is not a number"),
        ("summary.json", '{"calls": {"push_pull": {"calls": 3}}}', "lacks"),
        ("summary.json", '{"bytes_per_step": [1]}', "'bytes_per_step' is not an object"),
    ],
)  # fmt: skip
def test_report_refuses_malformed_run_files_by_name(
    tmp_path: Path, name: str, content: str, problem: str
) -> None:
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "trainer-0.jsonl").write_text('{"kind": "train", "step": 1}\n')
    (tmp_path / name).write_text(content)
    with pytest.raises(ConfigError, match=re.escape(problem)):
        write_report(tmp_path)
    (tmp_path / name).write_bytes(b"\xff\xfe{")
    with pytest.raises(ConfigError):
        write_report(tmp_path)


def test_report_of_a_directory_without_records_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no metric records"):
        write_report(tmp_path)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "trainer-0.jsonl").write_text('{"kind": "train", "step": 1, "lo')
    with pytest.raises(ConfigError, match="no metric records"):
        write_report(tmp_path)  # a torn line is skipped, leaving nothing
    (tmp_path / "summary.json").write_text("[1, 2")
    (tmp_path / "metrics" / "trainer-0.jsonl").write_text('{"kind": "train", "step": 1}\n')
    with pytest.raises(ConfigError, match="not valid JSON"):
        write_report(tmp_path)


@pytest.mark.system
def test_a_workers_peak_memory_is_its_own_not_its_launchers() -> None:
    """ru_maxrss of a forked and exec'd process starts at its parent's peak; a worker's
    reported peak must not."""
    import subprocess

    held = bytearray(600 * 2**20)
    held[::4096] = b"\x01" * (len(held) // 4096)  # touched: resident in this process
    code = (
        "import resource; from paramserver.observe import peak_rss_bytes; "
        "print(peak_rss_bytes() >> 20, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    own, inherited = (int(x) for x in out.stdout.split())
    del held
    assert inherited >= 600  # what the summary reported before: the launcher's peak
    assert own < 450, f"a fresh interpreter reported {own} MiB"


def test_startup_phases_run_from_the_commands_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from paramserver.observe import startup

    monkeypatch.setenv(startup.COMMAND_STARTED_AT, "100.0")
    monkeypatch.setattr(startup, "process_started_at", lambda: 102.5)
    monkeypatch.setattr(startup, "_marks", {"interpreter": 104.0, "rendezvous": 104.5})
    startup.mark("rendezvous")  # reached already: kept
    assert startup.startup_seconds() == {
        "launch": 2.5,
        "interpreter": 1.5,
        "rendezvous": 0.5,
        "model": None,
        "first_step": None,
        "total": 4.5,
    }
    with pytest.raises(ValueError, match="no start-up phase 'warmup'"):
        startup.mark("warmup")
    monkeypatch.delenv(startup.COMMAND_STARTED_AT)
    assert startup.command_started_at() == 102.5  # no launcher's word: this process's start
