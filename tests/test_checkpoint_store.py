"""Checkpoint store: round trip, retention, detection of every kind of damage, SIGKILL mid-write."""

from __future__ import annotations

import json
import logging
import pickle
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks.checkpoint_writer import WriterZygote, kill_trial, same_tensors
from paramserver.checkpoint import (
    CheckpointError,
    Part,
    checkpoint_dir,
    commit,
    load_latest,
    verify,
    write_part,
)
from tests.helpers import checkpoint_steps, commit_step, flip_byte, tensors_of, write_step

STORE_LOGGER = "paramserver.checkpoint.store"


def test_round_trip(tmp_path: Path) -> None:
    parts = write_step(tmp_path, 120)
    assert [pickle.loads(pickle.dumps(p)) for p in parts] == parts  # they travel by RPC
    directory = commit(tmp_path, 120, parts[::-1], {"job": "test", "num_servers": 3})
    assert directory == tmp_path / "ckpt-0000000120"
    assert (tmp_path / "LATEST").read_text() == "ckpt-0000000120\n"
    assert verify(directory) == []
    found = load_latest(tmp_path)
    assert found is not None
    assert (found.directory, found.step) == (directory, 120)
    assert found.meta == {"job": "test", "num_servers": 3}
    assert found.part_names == ("server-0", "server-1", "server-2")
    for w in range(3):
        tensors, meta = found.read_part(f"server-{w}")
        assert meta == {"writer": w, "step": 120}
        assert same_tensors(tensors, tensors_of(w, 120))
        assert tensors["view"].is_contiguous()
    # The view was saved as its 40 elements, not as the 8000 of its storage (32 kB).
    assert (directory / "server-0.pt").stat().st_size < 8000 * 4
    with pytest.raises(KeyError, match="server-9"):
        found.read_part("server-9")


def test_keep_deletes_old_and_stale_but_not_newer_uncommitted(tmp_path: Path) -> None:
    write_step(tmp_path, 15)  # stale: older than what gets committed, never committed
    write_step(tmp_path, 60)  # in progress: newer than LATEST
    for step in (10, 20, 30, 40, 50):
        commit_step(tmp_path, step, keep=2)
    assert checkpoint_steps(tmp_path) == [40, 50, 60]
    assert verify(checkpoint_dir(tmp_path, 40)) == []
    assert len(list(checkpoint_dir(tmp_path, 60).iterdir())) == 6  # untouched
    found = load_latest(tmp_path)
    assert found is not None and found.step == 50
    commit_step(tmp_path, 70, keep=3)
    assert checkpoint_steps(tmp_path) == [40, 50, 70]  # 60 never committed and now older


@pytest.mark.parametrize("keep", [0, 1, -1])
def test_keep_below_two_is_rejected(tmp_path: Path, keep: int) -> None:
    with pytest.raises(ValueError, match="keep"):
        commit(tmp_path, 1, write_step(tmp_path, 1), {}, keep=keep)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-3])


DAMAGE: dict[str, tuple[Callable[[Path], object], str]] = {
    "flip_pt_byte": (lambda d: flip_byte(d / "server-1.pt"), "server-1.pt: sha256 checksum"),
    "truncate_json": (lambda d: truncate(d / "server-2.json"), "server-2.json: size mismatch"),
    "delete_file": (lambda d: (d / "server-0.pt").unlink(), "server-0.pt: missing file"),
    "corrupt_manifest": (
        lambda d: (d / "manifest.json").write_bytes(b"\x00\xff{garbage"),
        "invalid manifest.json",
    ),
    "delete_manifest": (lambda d: (d / "manifest.json").unlink(), "no manifest.json"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_falls_back_to_previous(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    commit_step(tmp_path, 1)
    newest = commit_step(tmp_path, 2)
    corrupt, problem = DAMAGE[damage]
    corrupt(newest)
    assert any(problem in p for p in verify(newest)), verify(newest)
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        found = load_latest(tmp_path)
    assert found is not None and found.step == 1
    assert same_tensors(found.read_part("server-1")[0], tensors_of(1, 1))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(newest.name in w and problem in w for w in warnings), warnings


@pytest.mark.parametrize("latest", [b"\x00\x01garbage\xff", b"", b"ckpt-0000000099\n", b"../x"])
def test_unusable_latest_falls_through_to_the_scan(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, latest: bytes
) -> None:
    commit_step(tmp_path, 1)
    commit_step(tmp_path, 2)
    (tmp_path / "LATEST").write_bytes(latest)
    with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
        found = load_latest(tmp_path)
    # Both checkpoints are intact, so the scan finds the newest.
    assert found is not None and found.step == 2
    assert any("LATEST" in r.getMessage() for r in caplog.records), caplog.records
    assert verify(found.directory) == [] and verify(checkpoint_dir(tmp_path, 1)) == []


def test_all_damaged_raises_naming_each(tmp_path: Path) -> None:
    first = commit_step(tmp_path, 1)
    second = commit_step(tmp_path, 2)
    flip_byte(first / "server-0.pt")
    (second / "server-2.json").unlink()
    with pytest.raises(CheckpointError) as raised:
        load_latest(tmp_path)
    message = str(raised.value)
    assert f"{first.name}: server-0.pt: sha256 checksum mismatch" in message
    assert f"{second.name}: server-2.json: missing file" in message


def test_latest_naming_a_lost_checkpoint_raises(tmp_path: Path) -> None:
    (tmp_path / "LATEST").write_text("ckpt-0000000007\n")
    with pytest.raises(CheckpointError, match="ckpt-0000000007"):
        load_latest(tmp_path)


def test_no_checkpoint_is_none(tmp_path: Path) -> None:
    assert load_latest(tmp_path) is None
    assert load_latest(tmp_path / "absent") is None
    write_step(tmp_path, 5)  # written, never committed
    assert load_latest(tmp_path) is None


def manifest_of(directory: Path) -> dict:
    return json.loads((directory / "manifest.json").read_text())


def edit_files(edit: Callable[[list[Any]], object]) -> Callable[[dict], object]:
    return lambda m: edit(m["files"])


GARBAGE_MANIFESTS: dict[str, Callable[[dict], object] | bytes] = {
    "binary": bytes(range(256)) * 4,
    "not_utf8_json": b'{"a": "\xff\xfe"}',
    "deep_nesting": b"[" * 100_000 + b"]" * 100_000,
    "list": b"[1, 2, 3]",
    "null": b"null",
    "wrong_version": lambda m: m.update(version=2),
    "step_string": lambda m: m.update(step="2"),
    "step_bool": lambda m: m.update(step=True),
    "meta_list": lambda m: m.update(meta=[]),
    "parts_missing": lambda m: m.pop("parts"),
    "part_bad_name": lambda m: m["parts"].append("../evil"),
    "part_without_files": lambda m: m["parts"].append("server-7"),
    "files_dict": lambda m: m.update(files={}),
    "entry_not_object": edit_files(lambda f: f.append("server-0.pt")),
    "size_negative": edit_files(lambda f: f[0].update(size=-1)),
    "size_float": edit_files(lambda f: f[0].update(size=1.5)),
    "sha_short": edit_files(lambda f: f[0].update(sha256="abc")),
    "sha_int": edit_files(lambda f: f[0].update(sha256=7)),
    "name_missing": edit_files(lambda f: f[0].pop("name")),
    "listed_twice": edit_files(lambda f: f.append(dict(f[0]))),
    "escape_parent": edit_files(lambda f: f.append({**f[0], "name": "../LATEST"})),
    "escape_absolute": edit_files(lambda f: f.append({**f[0], "name": "/etc/passwd"})),
    "escape_subdir": edit_files(lambda f: f.append({**f[0], "name": "a/b"})),
    "name_dotdot": edit_files(lambda f: f.append({**f[0], "name": ".."})),
    "name_nul": edit_files(lambda f: f.append({**f[0], "name": "a\x00b"})),
    "name_manifest": edit_files(lambda f: f.append({**f[0], "name": "manifest.json"})),
    "step_mismatch": lambda m: m.update(step=3),
    "file_wrong_size": edit_files(lambda f: f[0].update(size=f[0]["size"] + 1)),
    "file_wrong_sha": edit_files(lambda f: f[0].update(sha256="0" * 64)),
}


@pytest.mark.parametrize("garbage", sorted(GARBAGE_MANIFESTS))
def test_verify_reports_garbage_without_raising(tmp_path: Path, garbage: str) -> None:
    directory = commit_step(tmp_path, 2)
    edit = GARBAGE_MANIFESTS[garbage]
    if isinstance(edit, bytes):
        raw = edit
    else:
        manifest = manifest_of(directory)
        edit(manifest)
        raw = json.dumps(manifest).encode()
    (directory / "manifest.json").write_bytes(raw)
    problems = verify(directory)
    assert problems and all(isinstance(p, str) for p in problems)
    with pytest.raises(CheckpointError, match=directory.name):
        load_latest(tmp_path)


def test_verify_rejects_a_symlink_in_place_of_a_file(tmp_path: Path) -> None:
    directory = commit_step(tmp_path, 1)
    outside = tmp_path / "outside.pt"
    (directory / "server-0.pt").rename(outside)
    (directory / "server-0.pt").symlink_to(outside)
    assert verify(directory) == ["server-0.pt: not a regular file"]


@pytest.mark.parametrize("name", ["", "a/b", "..", ".hidden", "manifest", "x y", "é", "a" * 201])
def test_bad_part_names_are_rejected(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="part name"):
        write_part(tmp_path / "ckpt-0000000001", name, {}, {})


def test_commit_checks_parts_against_the_disk(tmp_path: Path) -> None:
    parts = write_step(tmp_path, 1)
    directory = checkpoint_dir(tmp_path, 1)
    flip_byte(directory / "server-1.pt")
    with pytest.raises(CheckpointError, match="server-1.pt"):
        commit(tmp_path, 1, parts, {})
    (directory / "server-2.json").unlink()
    with pytest.raises(CheckpointError, match="server-2.json"):
        commit(tmp_path, 1, [parts[2]], {})
    with pytest.raises(ValueError, match="twice"):
        commit(tmp_path, 1, [parts[0], parts[0]], {})
    forged = Part("server-0", {"../LATEST": (1, "0" * 64)})
    with pytest.raises(ValueError, match="files must be"):
        commit(tmp_path, 1, [forged], {})
    assert not (directory / "manifest.json").exists()
    assert not (tmp_path / "LATEST").exists()


def test_read_part_rechecks_files_changed_after_loading(tmp_path: Path) -> None:
    commit_step(tmp_path, 1)
    found = load_latest(tmp_path)
    assert found is not None
    flip_byte(found.directory / "server-0.pt")
    with pytest.raises(CheckpointError, match="server-0.pt: changed"):
        found.read_part("server-0")
    assert found.read_part("server-1")[1] == {"writer": 1, "step": 1}


@pytest.mark.system
@pytest.mark.timeout(60)
def test_sigkill_at_random_moments_leaves_a_loadable_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """24 writers on one root, each SIGKILLed at a random moment after its first commit."""
    rng = random.Random(1234)
    with WriterZygote() as zygote:
        for trial in range(24):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger=STORE_LOGGER):
                result = kill_trial(zygote, tmp_path, rng, max_delay=0.3)
            assert result.ok, f"trial {trial}: {result.detail}"
            assert not caplog.records, caplog.records  # LATEST's checkpoint loads first time
    assert len(checkpoint_steps(tmp_path)) <= 4  # keep=2, plus one in flight, one mid-prune
