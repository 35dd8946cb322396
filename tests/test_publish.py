"""Publishing from a training job (--publish-dir): the servers' change logs, followed by a
served model from the job's initial model, end at the job's final model, bitwise; a sync job's
versions are the model after one step on every server; publishing off changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import paramserver as ps
from paramserver import cli
from paramserver.changelog.log import ChainFollower, read_manifest, server_dir
from paramserver.checkpoint import load_latest, open_checkpoint
from paramserver.serving.follow import Follower
from paramserver.serving.model import ServedModel
from paramserver.serving.run import serve
from tests.field_models import BatchNormedFields, batch_normed_batches
from tests.helpers import HashedModel, TinyRecModel, hashed_batches, mse, tiny_batches
from tests.serving_helpers import raw_http


def served_state(served: ServedModel) -> dict[str, torch.Tensor]:
    """What serving holds, as a plain state_dict (a dynamic table's rows sorted by id)."""
    state = {}
    for name, slot in served.store.dense.items():
        state[name] = slot.value.clone()
    exported = served.store.export_state()
    for name, spec in served.plan.tables.items():
        rows = exported[name]
        if spec.dynamic is None:
            state[name] = rows["value"][torch.argsort(rows["ids"])]
        else:
            order = torch.argsort(rows["ids"])
            state[name.removesuffix("weight") + "ids"] = rows["ids"][order]
            state[name] = rows["value"][order]
    return state


def follow_all(model_fn, root: Path) -> ServedModel:
    served = ServedModel(model_fn, 0)
    follower = Follower(served, root)
    while follower.poll():
        pass
    assert follower.problems == {}
    return served


JOBS = {  # a model and its data: buffers (batch-norm statistics) are the job's state too
    "tiny": (TinyRecModel, lambda t, n: tiny_batches(t, 30)),
    "batch-normed": (BatchNormedFields, lambda t, n: batch_normed_batches(t)),
}


@pytest.mark.parametrize("job", sorted(JOBS))
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_log_of_a_job_ends_at_its_final_model(tmp_path: Path, mode: str, job: str) -> None:
    model_fn, data_fn = JOBS[job]
    config = ps.TrainConfig(
        servers=2, trainers=2, mode=mode, launcher="threads", optimizer="adagrad", lr=0.1,
        publish_dir=str(tmp_path), publish_every=0.01, progress=False,
    )  # fmt: skip
    result = ps.train(model_fn, data_fn, mse, config)
    assert result is not None and result.model is not None
    served = follow_all(model_fn, tmp_path)
    final = {k: v for k, v in result.model.state_dict().items()}
    assert served_state(served).keys() == final.keys()
    for name, value in served_state(served).items():
        assert torch.equal(value, final[name]), name
    segments = [ChainFollower(tmp_path, s).pending()[0] for s in (0, 1)]
    assert all(len(chain) >= 2 for chain in segments)  # cut during the job, not only at its end
    if mode == "sync":  # every server cut at the same rounds
        assert [s.last_step for s in segments[0]] == [s.last_step for s in segments[1]]
        assert all(s.aligned for chain in segments for s in chain)


def test_a_dynamic_tables_evictions_are_published_as_tombstones(tmp_path: Path) -> None:
    class Expiring(HashedModel):
        def __init__(self) -> None:
            super().__init__(dynamic=True)
            self.emb = ps.DynamicEmbedding(4, mode="mean", init_scale=0.1, ttl_steps=2)

    config = ps.TrainConfig(
        servers=2, trainers=1, launcher="threads", optimizer="sgd", lr=0.1,
        publish_dir=str(tmp_path), publish_every=0.01, progress=False,
    )  # fmt: skip
    result = ps.train(Expiring, lambda t, n: hashed_batches(t, 30), mse, config)
    assert result is not None and result.model is not None
    removed = sum(
        s.tables["emb.weight"].removed.numel()
        for server in (0, 1)
        for s in ChainFollower(tmp_path, server).pending()[0]
        if "emb.weight" in s.tables
    )
    assert removed > 0
    served = follow_all(Expiring, tmp_path)
    final = result.model.state_dict()
    held = served_state(served)
    assert torch.equal(held["emb.ids"], final["emb.ids"])
    assert torch.equal(held["emb.weight"], final["emb.weight"])


def test_a_new_job_refuses_a_publish_dir_that_holds_another_jobs_log(tmp_path: Path) -> None:
    config = ps.TrainConfig(
        servers=2, trainers=1, launcher="threads", publish_dir=str(tmp_path), progress=False
    )
    ps.train(TinyRecModel, lambda t, n: tiny_batches(t, 3), mse, config)
    with pytest.raises(
        ps.ConfigError, match=r"already holds a change log \(servers 0, 1\).*--resume"
    ):
        ps.train(TinyRecModel, lambda t, n: tiny_batches(t, 3), mse, config)


def test_the_command_line_refuses_a_used_publish_dir_with_one_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--steps", "3", "--servers", "2", "--trainers", "1", "--launcher",
            "threads", "--no-progress", "--publish-dir", str(tmp_path / "log"),
            "--checkpoint-dir", str(tmp_path / "ckpt")]  # fmt: skip
    assert cli.main(argv) == 0
    capsys.readouterr()
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.count("already holds a change log (servers 0, 1)") == 1
    assert cli.main([*argv, "--resume"]) == 0  # a resumed job continues the chains


def test_serving_from_the_newest_checkpoint_replays_the_log_kept_since(tmp_path: Path) -> None:
    """The log keeps every segment since the newest checkpoint (when the last was taken),
    whatever --publish-keep says: serving from that checkpoint replays to the job's final
    model."""
    config = ps.TrainConfig(
        servers=2, trainers=1, mode="sync", launcher="threads", publish_dir=str(tmp_path / "log"),
        publish_every=0.001, publish_keep=1, checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=10, progress=False,
    )  # fmt: skip
    result = ps.train(TinyRecModel, lambda t, n: tiny_batches(t, 35), mse, config)
    assert result is not None and result.model is not None
    assert load_latest(tmp_path / "ckpt").step == 35  # type: ignore[union-attr]  # the final
    base = open_checkpoint(tmp_path / "ckpt" / "ckpt-0000000030")  # the newest before it
    served = ServedModel(TinyRecModel, 0)
    served.load_checkpoint(base)
    follower = Follower(served, tmp_path / "log")
    follower.catch_up()
    assert follower.problems == {}
    final = result.model.state_dict()
    for name, value in served_state(served).items():
        assert torch.equal(value, final[name]), name


def test_serve_after_the_log_was_pruned_serves_the_jobs_newest_checkpoint_or_refuses(
    tmp_path: Path,
) -> None:
    """Each log keeps one segment and those since the newest checkpoint: it no longer reaches
    back to the job's initial model. serve() starts from the job's newest checkpoint instead
    (ready with the final model, its version placed in the chains), and refuses (before it
    listens) where it is not told of the job's checkpoints."""
    log, checkpoints = tmp_path / "log", tmp_path / "ckpt"
    config = ps.TrainConfig(
        servers=2, trainers=1, mode="sync", launcher="threads", publish_dir=str(log),
        publish_every=0.001, publish_keep=1, checkpoint_dir=str(checkpoints),
        checkpoint_every=10, progress=False,
    )  # fmt: skip
    result = ps.train(TinyRecModel, lambda t, n: tiny_batches(t, 35), mse, config)
    assert result is not None and result.model is not None
    assert ChainFollower(log, 0).gap() is not None  # pruned past the job's start
    with pytest.raises(ps.ConfigError, match=r"initial model .*pass --from"):
        serve(TinyRecModel, follow=log, http_port=0, grpc_port=None)
    serving = serve(TinyRecModel, follow=log, checkpoint_dir=checkpoints, http_port=0,
                    grpc_port=None)  # fmt: skip
    try:
        assert serving.http_port is not None
        status, _ = raw_http(serving.http_port, "GET", "/v2/health/ready", b"")
        assert status == 200
        final = result.model.state_dict()
        for name, value in served_state(serving.served).items():
            assert torch.equal(value, final[name]), name
        version = serving.served.version
        last = [read_manifest(server_dir(log, s)).segments[-1] for s in (0, 1)]
        assert version.number == sum(entry.sequence for entry in last) > 0
        assert version.steps == {0: 35, 1: 35}
    finally:
        serving.close()


def test_serve_rebuilds_the_recorded_job_where_it_ran_and_without_its_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The train command's record keeps the directory it ran in: serving started elsewhere
    reads the job's relative paths there (its --config here), and needs no training data to
    rebuild a Criteo job's model and inputs."""
    job_dir, elsewhere = tmp_path / "job", tmp_path / "elsewhere"
    job_dir.mkdir()
    elsewhere.mkdir()
    (job_dir / "job.toml").write_text("seed = 7\n")
    monkeypatch.chdir(job_dir)
    cli.record_job(Path("log"), ["--dataset", "criteo:data/gone.txt", "--config", "job.toml"])
    monkeypatch.chdir(elsewhere)
    job = cli.recorded_job(job_dir / "log" / cli.JOB_RECORD)
    assert job.config.seed == 7 and Path.cwd() == elsewhere
    assert [(tuple(t.shape), t.dtype) for t in job.example] == [
        ((2, 13), torch.float32),
        ((2, 26), torch.int64),
    ]
    model = job.model_fn()
    assert model(*job.example).shape == (2,)
    (job_dir / "job.toml").unlink()
    with pytest.raises(ps.ConfigError, match=r"recorded job \(run in .*job\).*job.toml"):
        cli.recorded_job(job_dir / "log" / cli.JOB_RECORD)
