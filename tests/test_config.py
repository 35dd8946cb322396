"""TrainConfig validation, TOML files and the flags derived from the dataclass."""

from __future__ import annotations

from pathlib import Path

import pytest

import paramserver as ps
from paramserver.cli import build_parser, config_from_args, main
from paramserver.config import TrainConfig, read_toml


@pytest.mark.parametrize(
    ("changes", "flag"),
    [
        ({"servers": 0}, "--servers"),
        ({"trainers": -1}, "--trainers"),
        ({"mode": "eventual"}, "--mode"),
        ({"optimizer": "lbfgs"}, "--optimizer"),
        ({"lr": 0.0}, "--lr"),
        ({"steps": 0}, "--steps"),
        ({"accumulate": 0}, "--accumulate"),
        ({"rpc_timeout": -5.0}, "--rpc-timeout"),
        ({"clip_grad_norm": 0.0}, "--clip-grad-norm"),
        ({"table_optimizer": "nope"}, "--optimizer"),
        ({"optimizer": "rowwise_adagrad"}, "--table-optimizer rowwise_adagrad"),
        ({"steps": "10"}, "--steps must be of type"),
        ({"lr": "fast"}, "--lr must be of type"),
        ({"progress": 1}, "--progress must be of type"),
        ({"ssp_bound": -1}, "--ssp-bound must be an integer >= 0"),
    ],
)
def test_invalid_values_name_the_flag_to_change(changes: dict[str, object], flag: str) -> None:
    with pytest.raises(ps.ConfigError, match=flag):
        TrainConfig(**changes)  # type: ignore[arg-type]


def test_every_field_is_a_flag_and_flags_override_the_toml_file(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(
        'servers = 3\nmode = "sync"\nlr = 0.5\nrpc-threads = 4\n'
        '[tables."emb.weight"]\nname = "adam"\nlr = 0.001\nbetas = [0.8, 0.9]\n'
    )
    args = build_parser().parse_args(
        ["train", "--config", str(job), "--lr", "0.25", "--trainers", "5", "--no-prefetch"]
    )
    config = config_from_args(args)
    assert (config.servers, config.mode, config.rpc_threads) == (3, "sync", 4)
    assert (config.lr, config.trainers, config.prefetch) == (0.25, 5, False)
    table = config.table_optimizer_for("emb.weight")
    assert (table.name, table.lr, table.betas) == ("adam", 0.001, (0.8, 0.9))
    assert config.table_optimizer_for("other.weight").name == "adagrad"
    help_text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()  # type: ignore[union-attr]
    for flag in (
        "--servers",
        "--trainers",
        "--mode",
        "--steps",
        "--epochs",
        "--batch-size",
        "--optimizer",
        "--lr",
        "--seed",
        "--rpc-threads",
        "--rpc-timeout",
        "--config",
        "--summary-json",
    ):
        assert flag in help_text


def test_toml_errors_are_config_errors(tmp_path: Path) -> None:
    bad_key = tmp_path / "bad.toml"
    bad_key.write_text("severs = 2\n")
    with pytest.raises(ps.ConfigError, match="unknown key 'severs'"):
        config_from_args(build_parser().parse_args(["train", "--config", str(bad_key)]))
    broken = tmp_path / "broken.toml"
    broken.write_text("servers = \n")
    with pytest.raises(ps.ConfigError, match="not valid TOML"):
        config_from_args(build_parser().parse_args(["train", "--config", str(broken)]))
    with pytest.raises(ps.ConfigError, match="file not found"):
        config_from_args(build_parser().parse_args(["train", "--config", "/no/such.toml"]))


def test_cli_reports_bad_configuration_without_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from paramserver.cli import main

    assert main(["train", "--servers", "0"]) == 2
    err = capsys.readouterr().err
    assert "paramserver: error: --servers must be an integer >= 1" in err
    assert "Traceback" not in err


# Each renamed field: its old name, what the job needs for it to apply (as flags and as a TOML
# line), and its new name.
RENAMED = [
    ("staleness", ["--mode", "ssp"], 'mode = "ssp"', "ssp_bound"),
    ("cache_staleness", ["--cache-rows", "10"], "cache_rows = 10", "cache_lag"),
]


@pytest.mark.parametrize(("old", "needs", "setting", "new"), RENAMED)
@pytest.mark.parametrize("joined", [False, True])
def test_an_old_flag_is_refused_naming_the_new_one(
    old: str,
    needs: list[str],
    setting: str,
    new: str,
    joined: bool,
    capsys: pytest.CaptureFixture[str],
) -> None:
    flag = f"--{old.replace('_', '-')}"
    words = [f"{flag}=1"] if joined else [flag, "1"]
    assert main(["train", *needs, *words]) == 2
    assert f"{flag} was renamed --{new.replace('_', '-')}" in capsys.readouterr().err


@pytest.mark.parametrize(("old", "needs", "setting", "new"), RENAMED)
def test_an_old_key_is_refused_in_a_config_file(
    old: str, needs: list[str], setting: str, new: str, tmp_path: Path
) -> None:
    path = tmp_path / "job.toml"
    path.write_text(f"{setting}\n{old} = 1\n")
    with pytest.raises(ps.ConfigError, match=f"'{old}' .* was renamed '{new}'"):
        read_toml(path)
    path.write_text(f"{setting}\n{new} = 1\n")
    assert getattr(TrainConfig(**read_toml(path)), new) == 1


def test_the_ssp_bound_counts_prefetch() -> None:
    config = TrainConfig(mode="ssp", ssp_bound=1)
    assert config.consistency.ssp_bound == 0  # prefetch spends one step of the bound


@pytest.mark.parametrize(
    ("old", "new"), [("staleness", "ssp_bound"), ("cache_staleness", "cache_lag")]
)
def test_a_renamed_field_is_refused_in_python_naming_the_new_one(old: str, new: str) -> None:
    with pytest.raises(ps.ConfigError, match=f"'{old}' was renamed '{new}'"):
        ps.TrainConfig(**{old: 2})
