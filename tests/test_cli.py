"""The command line as a user meets it: switches, --help, `paramserver check`'s verdicts and exit
statuses; and what ``ps.train`` does with the CLI-facing settings of TrainConfig."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paramserver as ps
from paramserver.checkpoint import commit, write_part
from paramserver.cli import (
    CHECK_NONE_LOADS,
    CHECK_OK,
    CHECK_OLDER_LOADS,
    config_from_args,
    main,
)
from paramserver.cliargs import build_parser, switches
from paramserver.config import TrainConfig
from paramserver.types import Progress
from tests.helpers import TinyRecModel, mse, tiny_batches


def train_help() -> str:
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0]  # type: ignore[union-attr]
    return subcommands.choices["train"].format_help()  # type: ignore[no-any-return]


def parse(*flags: str) -> TrainConfig:
    return config_from_args(build_parser().parse_args(["train", *flags]))


# --- switches -------------------------------------------------------------------------------


def test_every_boolean_field_is_a_switch_with_a_no_form() -> None:
    booleans = [
        f.name
        for f in TrainConfig.__dataclass_fields__.values()
        if f.type == "bool" and f.metadata.get("cli", True)
    ]
    assert set(booleans) == {
        "prefetch",
        "prefetch_own_updates",
        "data_sockets",
        "resume",
        "gather_model",
        "progress",
        "tensorboard",
        "recover",
    }
    assert set(switches()) == {"--compare-single-process"} | {
        "--" + name.replace("_", "-") for name in booleans
    }
    for name in booleans:
        flag = name.replace("_", "-")
        needs = ["--publish-dir", "log"] if name == "recover" else []
        assert getattr(parse("--checkpoint-dir", "ckpt", *needs, f"--{flag}"), name) is True
        assert getattr(parse(f"--no-{flag}"), name) is False
    config = parse("--checkpoint-dir", "ckpt", "--resume")  # as the README writes it
    assert config.resume is True
    args = build_parser().parse_args(["train", "--compare-single-process"])
    assert args.compare_single_process is True
    assert build_parser().parse_args(["train"]).compare_single_process is False


@pytest.mark.parametrize(
    "words",
    [
        ["--resume", "true"],
        ["--progress", "false"],
        ["--no-prefetch", "0"],
        ["--tensorboard=off"],
        ["--compare-single-process", "yes"],
    ],
)
def test_a_value_after_a_switch_is_refused_naming_both_forms(
    words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", *words]) == 2
    err = capsys.readouterr().err
    positive = words[0].split("=")[0].replace("--no-", "--")
    assert "takes no value" in err and positive in err
    assert "--no-" + positive[2:] in err and "Traceback" not in err


def test_the_toml_file_still_takes_true_and_false(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text("prefetch = false\ngather_model = false\nprogress = true\n")
    config = parse("--config", str(job))
    assert (config.prefetch, config.gather_model, config.progress) == (False, False, True)
    assert parse("--config", str(job), "--prefetch").prefetch is True  # the flag wins


# --- --help ---------------------------------------------------------------------------------


def test_help_describes_train_prints_each_default_once_and_groups_the_data_flags() -> None:
    top = build_parser().format_help()
    assert "synthetic click logs" in top and "MovieLens" in top and "Criteo" in top
    text = train_help()
    lines = text.replace("\n", " ")
    for flag in ("--servers", "--batch-size", "--table-lr", "--resume", "--server-pooling"):
        assert flag in text
    assert "(default: --lr)" in lines and "(default: None)" not in lines
    help_of = {}
    for action in build_parser()._subparsers._group_actions[0].choices["train"]._actions:  # type: ignore[union-attr]
        help_of[action.dest] = action.help or ""
    for dest, described in help_of.items():
        assert described.count("(default:") <= 1, dest
    # --dataset and --eval-data under "data", the synthetic dataset's own flags apart.
    data_part = text[text.index("\ndata:") : text.index("\nsynthetic click logs")]
    assert "--dataset" in data_part and "--eval-data" in data_part
    synthetic_part = text[text.index("\nsynthetic click logs") : text.index("\njob (TrainConfig)")]
    for flag in ("--rows-per-table", "--train-batches", "--eval-samples"):
        assert flag in synthetic_part
    assert "--dataset DATASET" not in synthetic_part
    assert "table_optimizers" in text and "table_codecs" in text  # said to have no flag


def test_dynamic_embedding_documents_its_arguments() -> None:
    doc = ps.DynamicEmbedding.__doc__ or ""
    for argument in ("min_count", "ttl_steps", "capacity", "mode", "init_scale", "default_value"):
        assert f"{argument}:" in doc, argument


# --- paramserver check ----------------------------------------------------------------------


def checkpoint(root: Path, step: int) -> Path:
    directory = root / f"ckpt-{step:010d}"
    parts = [write_part(directory, "server-0", {"w": torch.full((4,), float(step))}, {})]
    return commit(root, step, parts, {"servers": 1}, keep=3)


def damage(directory: Path) -> None:
    victim = directory / "server-0.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))


def test_check_says_when_the_newest_checkpoint_is_intact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for step in (3, 6):
        checkpoint(tmp_path, step)
    assert main(["check", str(tmp_path)]) == CHECK_OK == 0
    out = capsys.readouterr().out
    assert "ckpt-0000000006: ok (step 6" in out and "the newest checkpoint" in out
    assert main(["check", str(tmp_path / "ckpt-0000000003")]) == CHECK_OK


def test_check_names_a_damaged_newest_and_the_one_a_resume_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for step in (3, 6, 9):
        checkpoint(tmp_path, step)
    damage(tmp_path / "ckpt-0000000009")
    (tmp_path / "ckpt-0000000012").mkdir()  # a checkpoint being written: no manifest yet
    assert main(["check", str(tmp_path)]) == CHECK_OLDER_LOADS == 3
    out = capsys.readouterr()
    assert "ckpt-0000000009: DAMAGED: " in out.out and "server-0.pt" in out.out
    assert "ckpt-0000000012: not committed" in out.out
    assert "the newest checkpoint, ckpt-0000000009, cannot be loaded" in out.out
    assert "a resume loads ckpt-0000000006 (step 6)" in out.out
    assert "skipping" not in out.err  # said once, plainly, above
    # The damaged one given alone: its problem, status 1.
    assert main(["check", str(tmp_path / "ckpt-0000000009")]) == CHECK_NONE_LOADS == 1
    assert "server-0.pt" in capsys.readouterr().err


def test_check_fails_when_no_checkpoint_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", str(tmp_path)]) == CHECK_NONE_LOADS  # nothing there
    assert "no checkpoint" in capsys.readouterr().err
    damage(checkpoint(tmp_path, 3))
    assert main(["check", str(tmp_path)]) == CHECK_NONE_LOADS
    assert "no checkpoint under" in capsys.readouterr().err


def test_check_statuses_are_documented_in_help() -> None:
    parser = build_parser()
    check = parser._subparsers._group_actions[0].choices["check"]  # type: ignore[union-attr]
    text = " ".join(check.format_help().split())
    for status in ("0 the newest", "1 no checkpoint", "3 the newest"):
        assert status in text


# --- ps.train and the CLI-facing settings ---------------------------------------------------


def tiny_config(**changes: object) -> TrainConfig:
    return TrainConfig(servers=1, trainers=1, launcher="threads", **changes)  # type: ignore[arg-type]


def test_train_refuses_batch_size_which_only_the_cli_datasets_use() -> None:
    data = tiny_batches(0, num_batches=2)
    with pytest.raises(ps.ConfigError, match="batch_size=64.*data_fn"):
        ps.train(TinyRecModel, data, mse, tiny_config(batch_size=64))
    with pytest.raises(ps.ConfigError, match="--batch-size must be >= 1"):
        TrainConfig(batch_size=0)
    # The CLI still sizes its datasets with it.
    assert parse("--batch-size", "64").batch_size == 64


@pytest.mark.system
def test_train_shows_progress_every_log_every_seconds_unless_told_not_to(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def slow(trainer: int, num_trainers: int):  # type: ignore[no-untyped-def]
        for batch in tiny_batches(trainer, num_batches=8):
            time.sleep(0.05)
            yield batch

    with caplog.at_level(logging.INFO, logger="paramserver"):
        ps.train(TinyRecModel, slow, mse, tiny_config(log_every=0.1))
    shown = [r.getMessage() for r in caplog.records if "samples/s" in r.getMessage()]
    assert 1 <= len(shown) <= 8 and shown[0].startswith("step ")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="paramserver"):
        ps.train(TinyRecModel, slow, mse, tiny_config(log_every=0.1, progress=False))
    assert not [r for r in caplog.records if "samples/s" in r.getMessage()]
    caplog.clear()
    seen: list[Progress] = []
    with caplog.at_level(logging.INFO, logger="paramserver"):
        ps.train(TinyRecModel, slow, mse, tiny_config(log_every=0.1), on_progress=seen.append)
    assert seen and not [r for r in caplog.records if "samples/s" in r.getMessage()]
    with pytest.raises(ps.ConfigError, match="--log-every"):
        TrainConfig(log_every=0)


class LookupModel(nn.Module):
    """One plain nn.Embedding (no bags) and a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids)).squeeze(-1)


def test_server_pooling_a_table_without_bags_is_refused_before_any_process_starts() -> None:
    batches = [(torch.tensor([1, 2, 3]), torch.zeros(3))]
    config = TrainConfig(
        servers=1, trainers=1, launcher="processes", server_pooling=("emb.weight",)
    )
    started = time.monotonic()
    with pytest.raises(ps.ConfigError, match=r"--server-pooling emb.weight: .*sum and mean bags"):
        ps.train(LookupModel, batches, F.mse_loss, config)
    assert time.monotonic() - started < 5  # no process was started and waited for
    with pytest.raises(ps.ConfigError, match="tables \\['nope.weight'\\]"):
        ps.train(LookupModel, batches, F.mse_loss, config.replace(server_pooling=("nope.weight",)))
