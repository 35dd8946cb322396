"""The README is executable: every fenced block of README.md runs here, so a documented command
cannot break unnoticed. Prose (inline commands such as the benchmark scripts') is not run.

How each block is covered (``test_every_block_of_the_readme_is_covered`` fails on a block or
command that has no entry in tests/readme_blocks.py, so a new one needs a decision there):

- ``sh`` blocks: every command (a line, ``\\`` continuations joined, comments dropped) has an
  entry in ``COMMANDS``. ``paramserver ...`` commands run through ``paramserver.cli.main`` (what
  the ``paramserver`` script calls) in one scratch directory, shortened with documented flags
  appended (argparse keeps the last of a repeated flag, so ``--checkpoint-every 4`` after the
  README's ``500`` wins): a small synthetic job (``SHORT``) or ``--steps``. Most run with
  ``--launcher threads`` (the same job in one process: seconds instead of process start-ups);
  the first command, the one that writes ``summary.json``, keeps the default processes launcher.
  Commands that cannot run as written here have a stated equivalent: ``make`` (a dry run: it
  builds the venv, and ``make test`` is the suite this test is part of), ``torchrun`` across two
  hosts (both commands run at once on this host, ``HOST_A`` being 127.0.0.1 on a free port,
  sockets on ``lo``), ``tensorboard`` (served on 127.0.0.1 and asked for its runs, then stopped).
- ``python`` blocks: each runs as a script (``python FILE``) in the scratch directory, as written.
- ``toml`` blocks: each is read by the config loader into a TrainConfig and is ``job.toml`` for
  ``--config job.toml``.
- Plain blocks: text (the file map), listed in ``TEXT_BLOCKS`` by their first line.

The README's summary keys and flag lists are compared with a real summary and the real parser.
Budget: about two minutes on 2 cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import fields
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
import torch

from paramserver.checkpoint import load_latest
from paramserver.cli import main
from paramserver.cliargs import build_parser, switches
from paramserver.config import TrainConfig, read_toml
from tests.procs import RedisServer, free_port
from tests.readme_blocks import (
    BIN,
    COMMANDS,
    README,
    REPO,
    TEXT_BLOCKS,
    THREADS,
    blocks_of,
    commands_of,
    python_block,
    readme_blocks,
    sh_commands,
    summary_keys_in_readme,
)

pytestmark = pytest.mark.system  # starts processes or whole jobs: the system tier


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory a newcomer works in: the README's job.toml is there."""
    directory = tmp_path_factory.mktemp("readme")
    (directory / "job.toml").write_text(blocks_of("toml")[0].text)
    return directory


def paramserver(command: str, directory: Path, summary: str | None = None) -> int:
    """Run a README `paramserver` command as covered in COMMANDS, in ``directory``; write the
    summary to ``summary`` (a file name) unless the command names its own."""
    run = COMMANDS[command]
    argv = shlex.split(command)[1:] + list(run.extra)
    if argv[0] == "train" and "--help" not in argv:
        if run.launcher_threads:
            argv += THREADS
        if summary is not None and "--summary-json" not in argv:
            argv += ["--summary-json", summary]
    cwd = os.getcwd()
    os.chdir(directory)
    try:
        return main(argv)
    except SystemExit as exit:  # --help
        return int(exit.code or 0)
    finally:
        os.chdir(cwd)


def run_script(text: str, directory: Path, name: str, timeout: float) -> str:
    path = directory / name
    path.write_text(text)
    done = subprocess.run(
        [sys.executable, str(path)], cwd=directory, capture_output=True, text=True,
        timeout=timeout, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )  # fmt: skip
    assert done.returncode == 0, f"{name}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


# --- coverage -------------------------------------------------------------------------------


def test_every_block_of_the_readme_is_covered() -> None:
    blocks = readme_blocks()
    languages = {b.language for b in blocks}
    assert languages <= {"sh", "python", "toml", ""}, f"a block in a new language: {languages}"
    listed = [c for b in blocks if b.language == "sh" for c in commands_of(b)]
    missing = [c for c in listed if c not in COMMANDS]
    assert not missing, f"README commands with no coverage in tests/test_readme.py: {missing}"
    assert not set(COMMANDS) - set(listed), "COMMANDS lists commands the README no longer has"
    for block in blocks:
        if block.language == "":
            first = block.text.splitlines()[0].strip()
            assert first in TEXT_BLOCKS, f"README.md:{block.line}: a plain block not covered"
    assert len(blocks_of("python")) == 6 and len(blocks_of("toml")) == 1  # each run below


# --- Quickstart -----------------------------------------------------------------------------


def test_make_targets_run_what_the_readme_says() -> None:
    for target, expected in (("run", ["paramserver train"]), ("test", ["ruff", "mypy", "pytest"])):
        assert f"make {target}" in COMMANDS
        dry = subprocess.run(
            ["make", "-n", target], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert dry.returncode == 0, dry.stderr
        for word in expected:
            assert word in dry.stdout, (target, dry.stdout)


# --- Command line ---------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_command_line_section_runs_and_its_lists_match_the_code(
    scratch: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    commands = sh_commands("Command line")
    assert len(commands) == 7
    # The criteo commands read the files the README's first Python block writes.
    run_script(python_block("write_synthetic_criteo("), scratch, "write_criteo.py", timeout=120)
    summaries: dict[str, dict[str, Any]] = {}
    for number, command in enumerate(commands):
        summary = f"summary-{number}.json"
        assert paramserver(command, scratch, summary) == 0, command
        if command.endswith("--help"):
            assert "--resume, --no-resume" in capsys.readouterr().out
            continue
        path = scratch / ("summary.json" if "summary.json" in command else summary)
        summaries[command] = json.loads(path.read_text())
    configured = summaries[commands[2]]  # job.toml: 2 servers, 4 trainers, sync
    assert (configured["servers"], configured["trainers"], configured["mode"]) == (2, 4, "sync")

    always, some = summary_keys_in_readme()
    expected = {  # the keys beyond `always` each run's summary has, as the README says
        commands[1]: {  # processes
            "attempts",
            "restarts",
            "server_restarts",
            "eval_auc",
            "eval_logloss",
            "eval_auc_ceiling",
        },
        commands[3]: {"eval_auc", "eval_logloss"},  # criteo with --eval-data
        commands[4]: {"eval_auc", "eval_logloss"},  # criteo with --eval-fraction
        commands[5]: {"eval_rmse", "eval_mae", "eval_rmse_mean_predictor", "single_process"},
    }
    for command, extra in expected.items():
        assert set(summaries[command]) == always | extra, command
    # `stream`: a stream's job, whose summary tests/test_follow_folder.py reads.
    assert some == set().union(*expected.values(), {"stream"})
    assert set(summaries[commands[5]]["single_process"]) >= {"samples_per_s", "eval_rmse"}


def test_the_readme_flag_lists_are_the_parsers() -> None:
    text = " ".join(README.read_text().split())
    config_part = text[text.index("Every field of `paramserver.TrainConfig` is a flag") :]
    config_part = config_part[: config_part.index("Besides these")]
    own_part = text[text.index("Besides these, `train` takes") :]
    own_part = own_part[: own_part.index("On/off settings")]
    switch_part = text[text.index("On/off settings are switches") :]
    switch_part = switch_part[: switch_part.index("A value after a switch")]

    train = build_parser()._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    flags = {a.option_strings[0] for a in train._actions if a.option_strings[0] != "-h"}
    config_flags = {f"--{f.name.replace('_', '-')}" for f in fields(TrainConfig)}
    without_flag = {f.name for f in fields(TrainConfig) if not f.metadata.get("cli", True)}

    assert set(re.findall(r"--[a-z-]+", config_part)) == config_flags & flags
    assert set(re.findall(r"`([a-z_]+)`", config_part)) == without_flag
    assert config_flags - flags == {f"--{n.replace('_', '-')}" for n in without_flag}
    assert set(re.findall(r"--[a-z-]+", own_part)) == flags - config_flags
    named = set(re.findall(r"`(--[a-z-]+[a-z])`", switch_part)) - {"--no-prefetch"}
    assert named == set(switches())
    for switch in switches():
        negative = "--no-" + switch[2:]
        assert negative in {s for a in train._actions for s in a.option_strings}


def test_toml_blocks_load_as_job_configs() -> None:
    for index, block in enumerate(blocks_of("toml")):
        path = README.parent / f".readme-{os.getpid()}-{index}.toml"
        try:
            path.write_text(block.text)
            values = read_toml(path)
        finally:
            path.unlink()
        config = TrainConfig(**values)
        assert config.table_optimizer_for("embeddings.0.weight").name == "rowwise_adagrad"
        assert config.codecs_for_table("embeddings.0.weight") == ("none", "fp16")


# --- Python API and tables keyed by hashed ids -----------------------------------------------


@pytest.mark.timeout(180)
def test_python_blocks_run_as_scripts(scratch: Path) -> None:
    api, tables = python_block("ps.run(MyModel"), python_block("DynamicEmbedding(")
    assert "ps.train(" in api
    out = run_script(api, scratch, "api.py", timeout=150)
    assert float(out.strip().splitlines()[-1]) > 0  # the printed training loss
    state = torch.load(scratch / "model.pt", weights_only=True)
    heads = {f"{head}.{kind}" for head in ("click", "conversion") for kind in ("weight", "bias")}
    assert set(state) == {"items.weight", *heads}
    assert "step 50: loss" in out and "held-out click rate" in out  # printed by the loop
    run_script(tables, scratch, "tables.py", timeout=60)
    # The job's start in one process, trained there, equals the job: asserted by the block.
    run_script(python_block("ps.initial_model("), scratch, "same_start.py", timeout=120)


# --- Many machines: torchrun ----------------------------------------------------------------


@pytest.mark.timeout(180)
def test_torchrun_commands_run_on_loopback(tmp_path: Path) -> None:
    commands = sh_commands("Many machines: torchrun")
    assert len(commands) == 2
    port = str(free_port())
    env = dict(os.environ, TP_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(REPO))
    processes = []
    for host, command in enumerate(commands):
        argv = shlex.split(command.replace("HOST_A", "127.0.0.1").replace("29500", port))
        argv[0] = str(BIN / argv[0])
        argv += [*COMMANDS[command].extra, "--summary-json", str(tmp_path / f"host{host}.json")]
        started = subprocess.Popen(
            argv, cwd=tmp_path, env=env, text=True, start_new_session=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        processes.append(started)
    try:
        outputs = [p.communicate(timeout=150)[0] for p in reversed(processes)]
    finally:
        for p in processes:  # everything this test started, by its process group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    assert [p.returncode for p in processes] == [0, 0], "\n".join(outputs)[-6000:]
    summary = json.loads((tmp_path / "host1.json").read_text())  # the chief trainer's host
    assert (summary["servers"], summary["trainers"], sum(summary["trainer_steps"])) == (2, 2, 24)


# --- Checkpoints and faults -----------------------------------------------------------------


@pytest.mark.timeout(120)
def test_checkpoint_commands_run_in_order(scratch: Path) -> None:
    commands = sh_commands("Checkpoints and faults")
    assert len(commands) == 10
    at_end, first, resumed, restarting, check, export = commands[:6]
    alone = scratch / "at_end"
    alone.mkdir()
    assert paramserver(at_end, alone) == 0
    found = load_latest(alone / "ckpt")
    assert found is not None and found.meta["final"] is True  # the only checkpoint: the end
    directory = scratch / "checkpoints"
    directory.mkdir()
    assert paramserver(first, directory, "first.json") == 0
    assert (directory / "ckpt" / "LATEST").exists()
    assert paramserver(resumed, directory, "resumed.json") == 0
    assert json.loads((directory / "resumed.json").read_text())["resumed_from"] is not None
    assert paramserver(restarting, directory, "restarting.json") == 0
    assert paramserver(check, directory) == 0
    assert paramserver(export, directory) == 0
    state = torch.load(directory / "model.pt", weights_only=True)
    assert "embeddings.0.weight" in state


@pytest.mark.timeout(120)
def test_the_resume_rule_trains_on_to_each_larger_budget(
    scratch: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    commands = sh_commands("Checkpoints and faults")[6:]
    directory = scratch / "budgets"
    directory.mkdir()
    ends = []
    for number, command in enumerate(commands):
        capsys.readouterr()
        assert paramserver(command, directory, f"budget-{number}.json") == 0, command
        summary = json.loads((directory / f"budget-{number}.json").read_text())
        began = summary["resumed_from"]["trainer_steps"] if summary["resumed_from"] else [0, 0]
        ends.append([a + b for a, b in zip(began, summary["trainer_steps"], strict=True)])
    assert ends == [[4, 4], [8, 8], [24, 24], [24, 24]]  # the last trained nothing, and says so
    assert capsys.readouterr().out.startswith("nothing to train: resumed from checkpoint 24")


# --- Watching a run -------------------------------------------------------------------------


def wait_ready(http: int, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready") as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        assert time.monotonic() < deadline, "serve never became ready"
        time.sleep(0.2)


@contextlib.contextmanager
def serving(argv: list[str], cwd: Path) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        argv, cwd=cwd, text=True, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


@pytest.mark.timeout(150)
def test_watching_a_run_commands(scratch: Path) -> None:
    commands = sh_commands("Watching a run")
    assert len(commands) == 3
    train, report, tensorboard = commands
    assert paramserver(train, scratch, "watched.json") == 0
    assert (scratch / "runs/a/profile").is_dir() and (scratch / "runs/a/metrics").is_dir()
    if find_spec("matplotlib") is None:
        pytest.skip("paramserver report needs matplotlib (pip install 'paramserver[report]')")
    assert paramserver(report, scratch) == 0
    assert (scratch / "runs/a/report/report.md").exists()
    assert (scratch / "runs/a/report/loss.png").exists()
    if find_spec("tensorboard") is None:
        pytest.skip("tensorboard is not installed (pip install 'paramserver[tensorboard]')")
    port = free_port()
    argv = [str(BIN / "tensorboard"), *shlex.split(tensorboard)[1:]]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    with serving(argv, scratch) as server:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=5) as r:
                    runs = json.loads(r.read())
                if runs:
                    break
            except OSError:
                pass
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            assert time.monotonic() < deadline, "tensorboard never listed the run"
            time.sleep(0.5)
    assert any(name.startswith("trainer") for name in runs), runs


# --- Serving while it trains ----------------------------------------------------------------


@pytest.mark.timeout(180)
def test_serving_commands_answer_curl_and_tritonclient(scratch: Path) -> None:
    train, serve, curl = sh_commands("Serving while it trains")
    directory = scratch / "serving"
    directory.mkdir()
    assert paramserver(train, directory, "published.json") == 0
    assert (directory / "log" / "job.json").exists() and (directory / "ckpt" / "LATEST").exists()
    http, grpc = free_port(), free_port()
    argv = [str(BIN / "paramserver"), *shlex.split(serve)[1:]]
    argv += ["--http-port", str(http), "--grpc-port", str(grpc)]
    with serving(argv, directory) as server:
        wait_ready(http, server)
        written = next(line for line in README.read_text().splitlines() if line.startswith("curl"))
        assert " ".join(shlex.split(written)) == curl
        answer = subprocess.run(
            shlex.split(written.replace("localhost:8000", f"127.0.0.1:{http}")),
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
        rows = json.loads(answer)["outputs"][0]
        assert rows["name"] == "rows" and rows["shape"] == [3, 16]
        script = python_block("localhost:8001").replace("localhost:8001", f"127.0.0.1:{grpc}")
        out = run_script(script, directory, "query.py", timeout=60)
        assert "0:" in out and "1:" in out  # the steps of both servers in the version read


# --- Online training ------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_online_training_serves_a_row_an_event_changed_and_stops_cleanly(tmp_path: Path) -> None:
    _, produce, train, serve, resume = sh_commands("Online training: a stream in, fresh rows out")
    redis_server = RedisServer(tmp_path)  # the README's `redis-server --port 6379`
    try:

        def here(command: str) -> list[str]:
            words = command.replace("localhost:6379", f"127.0.0.1:{redis_server.port}").split()
            words = [w for w in words if w != "&"]
            return [sys.executable if words[0] == "python" else str(BIN / words[0]), *words[1:]]

        http, grpc = free_port(), free_port()
        ports = ["--http-port", str(http), "--grpc-port", str(grpc)]
        # The job in one process (tests/test_stream_jobs.py stops the processes launcher's);
        # the producer goes on through the resume, as in the README.
        with serving(here(produce), tmp_path):
            with serving([*here(train), *THREADS], tmp_path) as trainer:
                wait_until_published = time.monotonic() + 60
                while not (tmp_path / "live" / "job.json").exists():
                    assert time.monotonic() < wait_until_published and trainer.poll() is None
                    time.sleep(0.1)
                with serving([*here(serve), *ports], tmp_path) as server:
                    wait_ready(http, server)
                    script = python_block('"localhost", 6379')
                    script = script.replace("localhost:8000", f"127.0.0.1:{http}")
                    redis_at = f'"127.0.0.1", {redis_server.port}'
                    script = script.replace('"localhost", 6379', redis_at)
                    out = run_script(script, tmp_path, "online.py", timeout=60)
                    assert "served changed" in out
                trainer.send_signal(signal.SIGTERM)  # the README's Ctrl-C or kill -TERM
                exited = trainer.wait(timeout=60)
                assert exited == 0, trainer.stderr.read() if trainer.stderr else ""
            found = load_latest(tmp_path / "live-ckpt")
            assert found is not None and found.meta.get("final")
            # --steps counts from the job's start: every trainer trains on to the new budget.
            budget = max(end["steps_done"] for end in found.meta["stream_ends"].values()) + 2
            more = ["--steps", str(budget), "--no-progress", *THREADS]
            resumed = subprocess.run([*here(resume), *more], cwd=tmp_path, timeout=120)
            assert resumed.returncode == 0
        again = load_latest(tmp_path / "live-ckpt")
        assert again is not None
        assert {end["steps_done"] for end in again.meta["stream_ends"].values()} == {budget}
    finally:
        redis_server.stop()
