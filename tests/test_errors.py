"""The typed errors: every one crosses RPC (pickled, or rebuilt from its message alone) with its
type and message intact, and every one is importable from the package's top level."""

from __future__ import annotations

import inspect
import pickle

import pytest

import paramserver as ps
from paramserver import errors

ERRORS = sorted(
    (
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, ps.ParamServerError) and cls.__module__ == errors.__name__
    ),
    key=lambda cls: cls.__name__,
)

# Keyword fields of the errors that have them, with values to carry across.
FIELDS: dict[type[Exception], dict[str, object]] = {
    errors.InvalidPushError: {"param": "mlp.0.weight", "server": 1},
    errors.ServerLostError: {"server": 1},
}


def test_the_error_list_is_the_module_s() -> None:
    names = {cls.__name__ for cls in ERRORS}
    assert {"ParamServerError", "ServerLostError", "CheckpointError"} <= names
    assert set(FIELDS) <= set(ERRORS)


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
def test_every_error_survives_pickling_and_a_rebuild_from_its_message(
    cls: type[Exception],
) -> None:
    fields = FIELDS.get(cls, {})
    error = cls("what went wrong", **fields)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is cls
    assert str(again) == str(error)
    for name, value in fields.items():
        assert getattr(again, name) == value, name
    # torch's RPC re-raises a remote error as type(message): the message alone must rebuild it
    # unchanged (no field prefixed twice).
    assert str(cls(str(error))) == str(error)


def test_fields_are_named_in_the_message() -> None:
    pushed = errors.InvalidPushError("NaN in gradient", param="mlp.0.weight", server=1)
    assert str(pushed) == "server 1: parameter 'mlp.0.weight': NaN in gradient"
    lost = errors.ServerLostError("server 1 was lost: push_pull failed with EOF", server=1)
    assert str(lost) == "server 1 was lost: push_pull failed with EOF"
    assert errors.ServerLostError(str(lost)).server is None  # rebuilt from the message alone


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
def test_every_error_is_exported_from_the_package(cls: type[Exception]) -> None:
    assert getattr(ps, cls.__name__) is cls
    assert cls.__name__ in ps.__all__


def test_everything_in_all_is_importable() -> None:
    for name in ps.__all__:
        assert hasattr(ps, name), name
