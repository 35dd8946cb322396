"""Codecs on the wire: jobs train with each, bytes shrink as documented, bad encodings are
refused whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import paramserver as ps
from paramserver.cli import build_parser, config_from_args
from paramserver.errors import InvalidPushError
from paramserver.wire.compression import Encoded, encode
from paramserver.wire.messages import PushPullRequest, RowBlock
from tests.helpers import MakeServer, TinyRecModel, a_dense_name, mse, own_ids, tiny_batches


def run(**codecs: object) -> dict[str, object]:
    config = ps.TrainConfig(
        servers=2, trainers=2, optimizer="sgd", lr=0.05, launcher="threads", progress=False,
        **codecs,
    )  # type: ignore[arg-type]  # fmt: skip
    data = lambda t, n: tiny_batches(t, num_batches=15)  # noqa: E731
    return ps.train(TinyRecModel, data, mse, config).summary


@pytest.mark.parametrize(
    ("codecs", "push_ratio", "pull_ratio"),
    [
        ({}, (1.0, 1.0), (1.0, 1.0)),
        ({"dense_push_codec": "fp16", "table_push_codec": "fp16"}, (0.5, 0.75), (1.0, 1.0)),
        ({"dense_pull_codec": "bf16", "table_pull_codec": "bf16"}, (1.0, 1.0), (0.5, 0.5)),
        ({"dense_pull_codec": "int8", "table_pull_codec": "int8"}, (1.0, 1.0), (0.25, 0.75)),
        ({"dense_push_codec": "topk", "topk_ratio": 0.1}, (0.1, 0.9), (1.0, 1.0)),
    ],
)
def test_each_codec_trains_and_shrinks_the_bytes_it_is_used_for(
    codecs: dict[str, object], push_ratio: tuple[float, float], pull_ratio: tuple[float, float]
) -> None:
    summary = run(**codecs)
    ratio = summary["compression_ratio"]
    assert push_ratio[0] <= ratio["push"] <= push_ratio[1]  # type: ignore[index]
    assert pull_ratio[0] <= ratio["pull"] <= pull_ratio[1]  # type: ignore[index]
    assert summary["train_loss"] < 2.0  # type: ignore[operator]


def test_codecs_change_the_result_only_within_their_accuracy() -> None:
    baseline = run()["train_loss"]
    for codecs in ({"dense_push_codec": "int8"}, {"table_pull_codec": "fp16"}):
        assert abs(run(**codecs)["train_loss"] - baseline) < 0.05  # type: ignore[operator]


def test_a_malformed_or_mismatched_encoding_is_refused_and_changes_nothing(
    make_server: MakeServer,
) -> None:
    server = make_server()
    dense = a_dense_name(server)
    shape = tuple(server.shard.store.dense[dense].value.shape)
    good_rows = {"user.weight": RowBlock(own_ids(server, 0), torch.ones(1, 4))}
    wrong_shape = encode("int8", torch.ones(shape[0] + 1, *shape[1:]))
    nan_scale = encode("int8", torch.ones(shape))
    nan_scale.tensors[1][0] = float("nan")
    bad_rows = RowBlock(own_ids(server, 0, 1), encode("fp16", torch.ones(3, 4)))
    before = server.shard.store.state_hash()
    for dense_grads, row_grads in (
        ({dense: wrong_shape}, good_rows),
        ({dense: nan_scale}, good_rows),
        ({dense: Encoded("gzip", shape, (torch.ones(shape),))}, good_rows),
        ({}, {"user.weight": bad_rows}),
    ):
        request = PushPullRequest(0, 0, dense_grads=dense_grads, row_grads=row_grads)  # type: ignore[arg-type]
        with pytest.raises(InvalidPushError, match="malformed encoding"):
            server.coordinator.push_pull(request).wait()
    assert server.shard.store.state_hash() == before


def test_per_table_codecs_come_from_the_toml_file(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(
        'table-pull-codec = "fp16"\n'
        '[tables."user.weight"]\npush_codec = "int8"\n'
        '[tables."items.weight"]\nname = "sgd"\npull_codec = "bf16"\n'
    )
    config = config_from_args(build_parser().parse_args(["train", "--config", str(job)]))
    assert config.codecs_for_table("user.weight") == ("int8", "fp16")
    assert config.codecs_for_table("items.weight") == ("none", "bf16")
    assert config.table_optimizer_for("items.weight").name == "sgd"
    assert "user.weight" not in config.table_optimizers
    job.write_text('[tables."user.weight"]\npush_codec = "topk"\n')
    with pytest.raises(ps.ConfigError, match="tables.user.weight"):
        config_from_args(build_parser().parse_args(["train", "--config", str(job)]))


def test_per_table_codecs_from_the_package_top_level_shrink_that_tables_bytes_only() -> None:
    # What a user writes: everything from `import paramserver as ps`.
    config = ps.TrainConfig(table_codecs={"items.weight": ps.TableCodecs(pull="bf16")})
    assert config.codecs_for_table("items.weight") == ("none", "bf16")
    assert config.codecs_for_table("user.weight") == ("none", "none")
    ratio = run(table_codecs={"items.weight": ps.TableCodecs(pull="bf16")})["compression_ratio"]
    assert ratio["push"] == 1.0  # type: ignore[index]
    # Only that table's rows shrink (to half): the pull is smaller, far from half.
    assert 0.5 < ratio["pull"] < 1.0  # type: ignore[index]
    with pytest.raises(ps.ConfigError, match="choose from"):
        ps.TableCodecs(push="topk")
