"""TrainConfig as its sections: each field defined in one section, each component handed its
own section (or a view derived from sections in one place), each choice a ``Literal`` that
``--help`` offers and the checks enforce, naming the flag."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any, get_type_hints

import pytest

import paramserver as ps
from paramserver.cli import build_parser
from paramserver.config import (
    DENSE_SYNCS,
    GRADIENT_CODECS,
    LAUNCHERS,
    MODES,
    PUBLISH_CODECS,
    VALUE_CODECS,
    CheckpointSection,
    CodecsSection,
    ConsistencySettings,
    ObserveSection,
    OptimSection,
    Sections,
    ShardSettings,
    TrainConfig,
    choices_of,
    config_fields,
)
from paramserver.launch import roles
from paramserver.optimconfig import OPTIMIZERS
from paramserver.schedule import DECAYS
from paramserver.trainer import context, loop
from paramserver.trainer.client import PushCodecs
from paramserver.trainer.ownupdates import OwnUpdates
from tests.helpers import TinyRecModel, mse, tiny_batches

SECTIONS = get_type_hints(Sections)  # name -> section class


def test_each_field_belongs_to_exactly_one_section() -> None:
    owners: dict[str, list[str]] = {}
    for name, section in SECTIONS.items():
        for f in dataclasses.fields(section):
            owners.setdefault(f.name, []).append(name)
    assert {f.name for f in config_fields()} == set(owners)
    assert {name: found for name, found in owners.items() if len(found) != 1} == {}
    assert set(SECTIONS.values()) == set(TrainConfig.__bases__)  # the sections it is made of
    assert all(f.metadata.get("help") for f in config_fields())  # the field's help is its own


def test_a_section_holds_its_fields_values_and_nothing_else() -> None:
    config = TrainConfig(lr=0.2, mode="sync", checkpoint_dir="ckpt", checkpoint_every=5)
    sections = config.sections
    for name, section in SECTIONS.items():
        got = getattr(sections, name)
        assert type(got) is section
        for f in dataclasses.fields(section):
            assert getattr(got, f.name) == getattr(config, f.name)
    assert sections.optim.lr == 0.2 and sections.consistency.mode == "sync"
    assert not hasattr(sections.checkpoint, "lr") and not hasattr(sections.optim, "mode")
    assert sections.checkpoint.writes_checkpoints
    assert config.replace(lr=0.3).sections.optim.lr == 0.3  # made anew with the config
    assert pickle.loads(pickle.dumps(config)).sections == sections


def test_values_derived_from_sections_are_computed_once_and_agree() -> None:
    config = TrainConfig(mode="ssp", ssp_bound=5, steps_per_call=3, stall_timeout=30.0)
    consistency = config.sections.consistency
    assert consistency.servers_ssp_bound == 3 == config.consistency.ssp_bound
    assert config.consistency.stall_limit == consistency.stall_limit == config.stall_limit == 30.0
    assert config.consistency.max_message_bytes == config.sections.launch.max_message_bytes
    assert TrainConfig(mode="async").consistency.ssp_bound is None
    cached = TrainConfig(cache_rows=4, cache_lag=3)
    assert cached.shard_settings(["t"]).cache_lag == 3
    assert TrainConfig(cache_lag=3).shard_settings(["t"]).cache_lag is None


def _spy(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, seen: dict[str, Any]) -> None:
    """Record the arguments ``owner.name`` (a class, a function or a classmethod) is called
    with under ``seen[name]``, and call it."""
    original = getattr(owner, name)  # a classmethod comes bound to its class

    def record(*args: Any, **kwargs: Any) -> Any:
        seen[name] = args
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, staticmethod(record) if isinstance(owner, type) else record)


def test_each_component_is_handed_its_own_section(monkeypatch: pytest.MonkeyPatch) -> None:
    config = TrainConfig(
        servers=2, trainers=1, launcher="threads", progress=False, optimizer="sgd", steps=3
    )
    seen: dict[str, Any] = {}
    for owner, name in [
        (loop, "TrainerCheckpoints"),
        (loop, "Observer"),
        (roles, "Coordinator"),
        (roles, "ServerShard"),
    ]:
        _spy(monkeypatch, owner, name, seen)
    codecs: dict[str, Any] = {}
    own: dict[str, Any] = {}
    _spy(monkeypatch, PushCodecs, "of", codecs)
    _spy(monkeypatch, OwnUpdates, "of", own)
    assert context.OwnUpdates is OwnUpdates  # the class patched is the one the loop calls
    ps.train(TinyRecModel, lambda t, n: tiny_batches(t, num_batches=3), mse, config)

    s = config.sections
    assert type(seen["TrainerCheckpoints"][0]) is CheckpointSection
    assert seen["TrainerCheckpoints"][:2] == (s.checkpoint, config.checkpoint_job)
    assert type(seen["Observer"][1]) is ObserveSection and seen["Observer"][1] == s.observe
    assert type(codecs["of"][0]) is CodecsSection and codecs["of"][0] == s.codecs
    assert type(own["of"][0]) is OptimSection and own["of"][0] == s.optim  # prefetching
    assert seen["Coordinator"][1] == ConsistencySettings.of(s.consistency, s.launch, s.checkpoint)
    tables = seen["ServerShard"][4].table_rules.keys()
    assert seen["ServerShard"][4] == ShardSettings.of(s.optim, s.codecs, s.tables, tables)


# Each choice field and the values its Literal allows.
CHOICES = {
    "mode": MODES,
    "dense_sync": DENSE_SYNCS,
    "launcher": LAUNCHERS,
    "optimizer": OPTIMIZERS,
    "table_optimizer": OPTIMIZERS,
    "lr_decay": DECAYS,
    "dense_push_codec": GRADIENT_CODECS,
    "dense_pull_codec": VALUE_CODECS,
    "table_push_codec": VALUE_CODECS,
    "table_pull_codec": VALUE_CODECS,
    "publish_codec": PUBLISH_CODECS,
}


def test_the_choices_are_literal_types() -> None:
    hints = get_type_hints(TrainConfig)
    literals = {name: choices_of(hint) for name, hint in hints.items() if choices_of(hint)}
    assert literals == CHOICES


@pytest.mark.parametrize("name", sorted(CHOICES))
def test_a_choice_outside_its_literal_is_refused_naming_the_flag(name: str) -> None:
    flag = f"--{name.replace('_', '-')}"
    with pytest.raises(ps.ConfigError, match=f"^{flag}\\b.*unknown .*'nope'"):
        TrainConfig(**{name: "nope"})
    with pytest.raises(ps.ConfigError, match=f"^{flag} must be of type str"):
        TrainConfig(**{name: True})  # (a number: see lr_decay)


@pytest.mark.parametrize("name", sorted(CHOICES))
def test_help_offers_each_literals_values(name: str) -> None:
    train = build_parser()._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    action = next(a for a in train._actions if a.dest == name)
    assert tuple(action.choices) == CHOICES[name]  # type: ignore[arg-type]
