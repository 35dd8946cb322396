"""paramserver's compiled loops as the install builds and loads them (paramserver.native): built
beside torch, taking its tensors as they are; off where built with another torch or not at all;
a tensor they cannot read refused before anything is written."""

from __future__ import annotations

import os

import pytest
import torch

from paramserver import native, optim

compiled = pytest.mark.skipif(native.loops is None, reason="the compiled loops are off")


def test_the_install_built_the_compiled_loops() -> None:
    """setup.py's extension is optional, so a failed build would only show as lost speed."""
    if os.environ.get("PARAMSERVER_NATIVE") == "0":
        pytest.skip("turned off by PARAMSERVER_NATIVE=0")
    assert native.loops is not None
    assert optim._adagrad_loop_rounding() is not None  # one rounding gives torch's results
    # Built beside torch (the Makefile's install): the trainer's loops take its tensors, and
    # without that its lookups, bags and own updates would all be left to torch.
    assert native.takes_tensors() and torch.__version__ == native.loops.TORCH_VERSION


def test_without_the_loops_paramserver_runs_on_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """No loops where the install built none (no C compiler: the import fails) or where
    PARAMSERVER_NATIVE=0 turns them off; every user then takes its numpy path (the tests of
    idmap and optim run both, tests/conftest.py's loop_mode)."""
    monkeypatch.setenv("PARAMSERVER_NATIVE", "0")
    assert native._load() is None
    monkeypatch.setenv("PARAMSERVER_NATIVE", "1")

    def not_built(name: str) -> None:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(native.importlib, "import_module", not_built)
    assert native._load() is None


def test_loops_built_with_another_torch_are_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loops linked to another torch release's libraries would read its tensors by another
    layout: they are turned off, saying so, as if not built."""

    class OtherTorchs:
        TAKES_TENSORS, TORCH_VERSION = 1, "2.8.0+cpu"

    monkeypatch.setattr(native.importlib, "import_module", lambda name: OtherTorchs)
    with pytest.warns(UserWarning, match=r"built with torch 2\.8\.0\+cpu, not this"):
        assert native._load() is None
    monkeypatch.setattr(OtherTorchs, "TORCH_VERSION", torch.__version__)
    assert native._load() is OtherTorchs


@compiled
def test_the_loops_read_and_write_tensors_as_they_are() -> None:
    """A tensor goes to a loop as it is (a Parameter, one that requires grad and a view into
    a larger storage too): the loop reads and writes its memory, as numpy's view of it."""
    assert native.loops is not None and native.takes_tensors()
    table = torch.nn.Parameter(torch.arange(24, dtype=torch.float32).view(6, 4))
    positions = torch.tensor([5, 0, 5, 2])
    whole = torch.full((7, 4), -1.0)
    out = whole[2:6]  # a view at an offset of its storage
    native.loops.gather_rows([table], [(0, positions, out)], 4)
    assert torch.equal(out, table.detach()[positions]) and (whole[:2] == -1).all()
    grads = torch.zeros(6, 4)
    native.loops.scatter_rows([grads], [(0, positions, torch.ones(4, 4))], 4)
    assert grads[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 2.0]


@compiled
def test_tables_of_rows_the_loops_index_are_told_apart() -> None:
    """takes_rows (float32) and pools_rows (float32 or float64): 2-D, contiguous, on the CPU,
    every one of them; anything else goes to torch."""
    rows = torch.zeros(5, 4)
    assert native.takes_rows(rows, torch.nn.Parameter(torch.ones(2, 4)), rows[1:3])
    assert native.takes_rows()  # nothing to refuse
    refused = [
        rows.double(), rows.view(-1), rows[:, :2], rows.t(), rows.half(), rows.long(),
        torch.zeros(5, 4, device="meta"), rows.to_sparse(),
    ]  # fmt: skip
    for tensor in refused:
        assert not native.takes_rows(rows, tensor), tensor.dtype
    assert native.pools_rows(rows) and native.pools_rows(rows.double())
    assert not native.pools_rows(rows.half()) and not native.pools_rows(rows[:, ::2])


@compiled
@pytest.mark.parametrize(
    ("tensor", "why"),
    [
        (torch.zeros(6, 8)[:, ::2], "not contiguous"),
        (torch.zeros(6, 4, dtype=torch.complex64), "no buffer format"),
        (torch.zeros(6, 4, device="meta"), "not a strided CPU tensor"),
        (torch.zeros(6, 4).to_sparse(), "not a strided CPU tensor"),
        (torch.zeros(6, 4, dtype=torch.complex64).conj(), "conjugated"),
    ],
)
def test_a_tensor_the_loops_cannot_read_is_refused_with_a_type_error(
    tensor: torch.Tensor, why: str
) -> None:
    """Refused before anything is read or written, saying why, as a buffer of the wrong
    layout is; the output stays as it was."""
    assert native.loops is not None and native.takes_tensors()
    out = torch.full((2, 4), 7.0)
    with pytest.raises(TypeError, match=why):
        native.loops.gather_rows([tensor], [(0, torch.tensor([0, 1]), out)], 4)
    assert (out == 7.0).all()
