"""Codecs and error feedback: error bounds, wire sizes, and validation of untrusted encodings."""

from __future__ import annotations

import dataclasses
import math
import pickle
import random
from typing import Any

import pytest
import torch
from torch import Tensor

from paramserver.config import GRADIENT_CODECS
from paramserver.wire import compression
from paramserver.wire.compression import (
    Encoded,
    ErrorFeedback,
    decode,
    encode,
    error_bound,
    validate,
)

SHAPES: list[tuple[int, ...]] = [(), (0,), (0, 16), (16, 0), (1000,), (64, 16), (4, 5, 6)]
SCALES = [1e-6, 1.0, 1e4]
LOSSY = ("fp16", "bf16", "int8", "topk")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _round_trip(codec: str, x: Tensor, topk_ratio: float = 0.1) -> tuple[Encoded, Tensor, Tensor]:
    """Encode and decode ``x``; check shape, dtype and the bound; return (encoded, err, bound)."""
    encoded = encode(codec, x, topk_ratio=topk_ratio)
    assert validate(encoded, tuple(x.shape)) is None
    y = decode(encoded)
    assert y.dtype == torch.float32
    assert y.shape == x.shape
    err = (x.double() - y.double()).abs()
    bound = error_bound(codec, x)
    assert bound.shape == x.shape
    assert bool((err <= bound.double()).all()), f"{codec}: max excess {(err - bound).max()}"
    return encoded, err, bound


def _wide(n: int, max_exp: int, seed: int) -> Tensor:
    """Signed values with log-uniform magnitudes 2^-149 .. 2^max_exp (subnormals included)."""
    gen = _gen(seed)
    exps = torch.rand(n, generator=gen, dtype=torch.float64) * (max_exp + 149) - 149
    signs = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
    return (signs * torch.exp2(exps)).float()


# ---- round trips and bounds ----


@pytest.mark.parametrize("codec", GRADIENT_CODECS)
def test_round_trip_stays_within_the_documented_bound(codec: str) -> None:
    gen = _gen()
    for shape in SHAPES:
        for scale in SCALES:
            _round_trip(codec, torch.randn(shape, generator=gen) * scale)
    # Magnitudes across float32's whole range, subnormals included (fp16 below its overflow).
    _round_trip(codec, _wide(4000, 15 if codec == "fp16" else 127, seed=1))
    _round_trip(codec, _wide(4000, 127, seed=2).reshape(100, 40))


@pytest.mark.parametrize("codec", GRADIENT_CODECS)
def test_round_trip_of_rows_of_subnormals(codec: str) -> None:
    # int8 scales of such rows would underflow to 0 (or lose their precision) unless raised.
    x = torch.tensor([[3e-45, -1.4e-45, 0.0], [1e-40, 5e-41, -2e-41], [1e-38, 0.0, -1e-39]])
    _round_trip(codec, x, topk_ratio=0.5)


def test_int8_scales_are_the_rows_peak_over_127_rounded_up_to_bfloat16() -> None:
    x = _wide(4000, 120, seed=3).reshape(400, 10)
    x[7] = 0.0
    encoded, _, _ = _round_trip("int8", x)
    q, scales = encoded.tensors
    assert scales.dtype == torch.bfloat16
    peaks = x.abs().amax(dim=1).double()
    sent = scales.double()
    lowest = (peaks / 127).clamp_min(2.0**-126)
    live = peaks > 0
    assert bool((sent[live] >= lowest[live]).all())  # the scale covers the row's peak...
    assert bool((sent[live] <= lowest[live] * (1 + 2.0**-7)).all())  # ...rounded up, barely
    assert float(sent[7]) == 0.0
    assert set(q.abs().amax(dim=1)[live].tolist()) <= {126, 127}
    # The row whose float32 scale once cost more than half a scale: within the bound still.
    _round_trip("int8", torch.tensor([[9.615015029907227, -8.4415283203125]]))


def test_round_trip_with_a_value_above_fp16_max() -> None:
    x = torch.randn(8, 16, generator=_gen())
    x[3, 5] = 1e5
    for codec in GRADIENT_CODECS:
        _round_trip(codec, x)


@pytest.mark.parametrize("codec", ["fp16", "bf16"])
def test_float_bounds_are_tight(codec: str) -> None:
    x = torch.randn(20000, generator=_gen())
    _, err, bound = _round_trip(codec, x)
    assert float((err / x.double().abs()).max()) > 0
    # Random values come within a few percent of the worst case half-ulp.
    assert float((err / bound.double()).max()) > 0.9


def test_int8_bound_is_tight_and_small() -> None:
    x = torch.randn(64, 256, generator=_gen()) * torch.logspace(-3, 3, 64)[:, None]
    _, err, bound = _round_trip("int8", x)
    assert float(err.max()) > 0
    row_max = x.abs().amax(dim=1, keepdim=True).double()
    assert bool((bound.double() < 0.01 * row_max).all())
    assert float((err / bound.double()).max()) > 0.9


# ---- fallbacks ----


def test_fp16_above_65504_is_sent_exactly_as_none() -> None:
    x = torch.randn(100, generator=_gen())
    x[7] = -70000.0
    encoded = encode("fp16", x)
    assert encoded.codec == "none"
    assert encoded.nbytes == 400
    y = decode(encoded)
    assert bool(torch.isfinite(y).all())
    assert torch.equal(y, x)
    x[7] = 65504.0  # the largest fp16 still goes as fp16, exactly
    encoded = encode("fp16", x)
    assert encoded.codec == "fp16"
    assert float(decode(encoded)[7]) == 65504.0


def test_bf16_past_its_max_is_sent_as_none() -> None:
    x = torch.ones(10)
    x[0] = 3.4e38  # rounds to inf in bfloat16
    encoded = encode("bf16", x)
    assert encoded.codec == "none"
    assert torch.equal(decode(encoded), x)


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_is_sent_as_none(codec: str, bad: float) -> None:
    x = torch.randn(4, 50, generator=_gen())
    x[2, 17] = bad
    encoded = encode(codec, x, topk_ratio=0.05)
    assert encoded.codec == "none"
    assert torch.allclose(decode(encoded), x, rtol=0, atol=0, equal_nan=True)
    assert validate(encoded, (4, 50)) == "payload contains NaN or Inf"


# ---- layouts and wire sizes ----


@pytest.mark.parametrize(("codec", "bytes_per_element"), [("none", 4), ("fp16", 2), ("bf16", 2)])
def test_dense_codecs_nbytes(codec: str, bytes_per_element: int) -> None:
    encoded = encode(codec, torch.randn(30, 7, generator=_gen()))
    assert encoded.nbytes == 210 * bytes_per_element


def test_int8_payload_is_int8_plus_one_scale_per_row() -> None:
    x = torch.randn(8, 16, generator=_gen())
    x[2] = 0.0
    encoded = encode("int8", x)
    q, scales = encoded.tensors
    assert (q.dtype, tuple(q.shape)) == (torch.int8, (8, 16))
    assert (scales.dtype, tuple(scales.shape)) == (torch.bfloat16, (8,))
    assert encoded.nbytes == 8 * 16 + 2 * 8
    assert float(scales[2]) == 0.0
    assert int(q.abs().max()) in (126, 127)
    y = decode(encoded)
    assert torch.equal(y[2], torch.zeros(16))
    assert bool((y[[0, 1, 3]] != 0).any())
    for shape, rows in [((4, 5, 6), 4), ((1000,), 1), ((), 1), ((0, 3), 0)]:
        encoded = encode("int8", torch.randn(shape, generator=_gen()))
        numel = math.prod(shape)
        assert tuple(encoded.tensors[0].shape) == (rows, numel // rows if rows else 3)
        assert encoded.nbytes == numel + 2 * rows
    assert torch.equal(decode(encode("int8", torch.zeros(3, 4))), torch.zeros(3, 4))


def test_topk_keeps_exactly_the_k_largest_magnitudes() -> None:
    gen = _gen()
    magnitudes = torch.randperm(1000, generator=gen).float() + 1.0  # distinct
    x = (magnitudes * (torch.randint(0, 2, (1000,), generator=gen) * 2 - 1)).reshape(10, 100)
    encoded = encode("topk", x, topk_ratio=0.05)
    indices, values = encoded.tensors
    assert indices.dtype == torch.int32
    assert indices.numel() == 50
    assert encoded.nbytes == 8 * 50
    largest = set(torch.topk(x.abs().flatten(), 50).indices.tolist())
    assert set(indices.tolist()) == largest
    assert bool((indices[1:] > indices[:-1]).all())
    assert torch.equal(values, x.flatten()[indices.long()])
    y = decode(encoded)
    kept = y != 0
    assert int(kept.sum()) == 50
    assert torch.equal(y[kept], x[kept])  # kept values are exact
    assert float(x[~kept].abs().max()) < float(x[kept].abs().min())


def test_topk_k_rounds_up_and_covers_small_tensors() -> None:
    x = torch.randn(1000, generator=_gen())
    assert encode("topk", x, topk_ratio=1e-6).tensors[0].numel() == 1
    assert encode("topk", x, topk_ratio=0.0101).tensors[0].numel() == 11
    assert torch.equal(decode(encode("topk", x, topk_ratio=1.0)), x)
    assert encode("topk", torch.zeros(0, 4)).tensors[0].numel() == 0
    assert torch.equal(decode(encode("topk", torch.tensor(3.5))), torch.tensor(3.5))
    assert compression._index_dtype(2**31) == torch.int32
    assert compression._index_dtype(2**31 + 1) == torch.int64


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5, math.nan, math.inf, "0.1", None])
def test_bad_topk_ratio_raises(ratio: Any) -> None:
    with pytest.raises(ValueError, match="topk_ratio"):
        encode("topk", torch.randn(10), topk_ratio=ratio)


def test_unknown_codec_and_non_float32_input_raise() -> None:
    with pytest.raises(ValueError, match="none, fp16, bf16, int8, topk"):
        encode("gzip", torch.randn(3))
    with pytest.raises(ValueError, match="unknown codec"):
        error_bound("gzip", torch.randn(3))
    for bad in [torch.randn(3, dtype=torch.float64), torch.randn(3).half(), torch.arange(3)]:
        for codec in GRADIENT_CODECS:
            with pytest.raises(ValueError, match="float32"):
                encode(codec, bad)
    with pytest.raises(ValueError, match="float32"):
        encode("none", [1.0, 2.0])  # type: ignore[arg-type]


def test_encoded_pickles_and_decodes_the_same() -> None:
    x = torch.randn(6, 9, generator=_gen())
    for codec in GRADIENT_CODECS:
        encoded = encode(codec, x, topk_ratio=0.2)
        copy = pickle.loads(pickle.dumps(encoded))
        assert type(copy) is Encoded
        assert (copy.codec, copy.shape, copy.nbytes) == (codec, (6, 9), encoded.nbytes)
        assert torch.equal(decode(copy), decode(encoded))


def test_encode_detaches_autograd_inputs() -> None:
    x = torch.randn(5, requires_grad=True)
    for codec in GRADIENT_CODECS:
        encoded = encode(codec, x, topk_ratio=0.5)
        assert validate(encoded, (5,)) is None
        assert not decode(encoded).requires_grad


# ---- error feedback ----


@pytest.mark.parametrize(
    ("codec", "ratio"), [("topk", 0.05), ("int8", 0.01), ("bf16", 0.01), ("none", 0.01)]
)
def test_error_feedback_conserves_the_gradient_sum(codec: str, ratio: float) -> None:
    gen = _gen()
    feedback = ErrorFeedback()
    sent = torch.zeros(32, 16, dtype=torch.float64)
    total = torch.zeros_like(sent)
    total_abs = torch.zeros_like(sent)
    for step in range(50):
        g = torch.randn(32, 16, generator=gen) * 10 ** (step % 5 - 2)
        sent += decode(feedback.compress("w", g, codec, topk_ratio=ratio)).double()
        total += g.double()
        total_abs += g.double().abs()
    residual = feedback.residual("w")
    assert residual.dtype == torch.float32
    gap = float((sent + residual.double() - total).abs().max())
    assert gap <= 1e-5 * float(total_abs.max())
    if codec == "none":
        assert torch.equal(residual, torch.zeros(32, 16))
    else:  # the codec lost something, and the residual holds it
        assert float(residual.abs().max()) > 1e-5 * float(total_abs.max())


def test_topk_with_error_feedback_sends_every_coordinate() -> None:
    gen = _gen()
    g = (0.1 + torch.rand(200, generator=gen)) * (
        torch.randint(0, 2, (200,), generator=gen) * 2 - 1
    )
    feedback = ErrorFeedback()
    sent = torch.zeros(200, dtype=torch.float64)
    ever_sent = torch.zeros(200, dtype=torch.bool)
    steps = 1000
    for _ in range(steps):
        y = decode(feedback.compress("w", g, "topk", topk_ratio=0.05))
        sent += y.double()
        ever_sent |= y != 0
    assert bool(ever_sent.all())
    expected = steps * g.double()
    assert float(((sent - expected).abs() / expected.abs()).max()) < 0.15
    # What is owed stays bounded instead of growing with the number of steps.
    assert float(feedback.residual("w").abs().max()) < 25 * float(g.abs().max())
    # Without feedback the same k coordinates would be sent every step.
    assert int((decode(encode("topk", g, topk_ratio=0.05)) != 0).sum()) == 10


def test_error_feedback_rejects_changes_and_keeps_its_state() -> None:
    feedback = ErrorFeedback()
    with pytest.raises(KeyError):
        feedback.residual("w")
    feedback.compress("w", torch.randn(100, generator=_gen()), "topk", topk_ratio=0.1)
    before = feedback.residual("w")
    assert int((before != 0).sum()) == 90
    with pytest.raises(ValueError, match="changed shape"):
        feedback.compress("w", torch.randn(101), "topk")
    with pytest.raises(ValueError, match="float32"):
        feedback.compress("w", torch.randn(100, dtype=torch.float64), "topk")
    with pytest.raises(ValueError, match="unknown codec"):
        feedback.compress("w", torch.randn(100), "gzip")
    with pytest.raises(ValueError, match="topk_ratio"):
        feedback.compress("w", torch.randn(100), "topk", topk_ratio=2.0)
    assert torch.equal(feedback.residual("w"), before)
    feedback.residual("w").add_(1.0)  # a copy: the caller cannot corrupt the state
    assert torch.equal(feedback.residual("w"), before)
    feedback.compress("w", torch.zeros(100), "none")  # 'none' pays back everything owed
    assert torch.equal(feedback.residual("w"), torch.zeros(100))


# ---- validation of untrusted encodings ----


def test_validate_accepts_every_well_formed_encoding() -> None:
    gen = _gen()
    big = torch.randn(4, 8, generator=gen)
    big[0, 0] = 1e6
    for codec in GRADIENT_CODECS:
        for shape in SHAPES:
            x = torch.randn(shape, generator=gen)
            assert validate(encode(codec, x, topk_ratio=0.3), shape) is None
        assert validate(encode(codec, big), (4, 8)) is None
        assert validate(encode(codec, torch.zeros(4, 8)), torch.Size([4, 8])) is None
    # Non-contiguous payloads decode fine and are accepted.
    assert validate(Encoded("none", (8, 4), (big.t(),)), (8, 4)) is None


def _replace(encoded: Encoded, **changes: Any) -> Encoded:
    return dataclasses.replace(encoded, **changes)


def _malformed() -> list[tuple[str, object]]:
    """(what is wrong, message) pairs, each for an expected shape of (4, 8)."""
    x = torch.randn(4, 8, generator=_gen())
    none, fp16, bf16 = encode("none", x), encode("fp16", x), encode("bf16", x)
    int8, topk = encode("int8", x), encode("topk", x, topk_ratio=0.25)
    q, scales = int8.tensors
    idx, vals = topk.tensors

    def with_scale(value: float) -> Encoded:
        bad = scales.clone()
        bad[1] = value
        return _replace(int8, tensors=(q, bad))

    def with_index(position: int, value: int) -> Encoded:
        bad = idx.clone()
        bad[position] = value
        return _replace(topk, tensors=(bad, vals))

    class FakeEncoded(Encoded):
        pass

    no_fields = object.__new__(Encoded)
    inf_x = x.clone()
    inf_x[0, 0] = math.inf
    nan_vals = vals.clone()
    nan_vals[0] = math.nan
    q_min = q.clone()
    q_min[0, 0] = -128
    return [
        ("a bare tensor", x),
        ("a dict", {"codec": "none", "shape": (4, 8), "tensors": (x,)}),
        ("a subclass", FakeEncoded("none", (4, 8), (x,))),
        ("no fields", no_fields),
        ("unknown codec", _replace(none, codec="gzip")),
        ("non-str codec", _replace(none, codec=3)),
        ("huge codec name", _replace(none, codec="x" * 1_000_000)),
        ("shape mismatch", _replace(none, shape=(8, 4), tensors=(x.t(),))),
        ("shape as list", _replace(none, shape=[4, 8])),
        ("float dims", _replace(none, shape=(4.0, 8))),
        ("huge claimed shape", _replace(topk, shape=(10**12, 10**12))),
        ("tensor for tuple", _replace(none, tensors=x)),
        ("list for tuple", _replace(none, tensors=[x])),
        ("empty payload", _replace(none, tensors=())),
        ("fp16 with two tensors", _replace(fp16, tensors=(x.half(), x.half()))),
        ("int8 with one tensor", _replace(int8, tensors=(q,))),
        ("topk with three tensors", _replace(topk, tensors=(idx, vals, vals))),
        ("non-tensor payload", _replace(none, tensors=([1.0] * 32,))),
        ("None payload", _replace(int8, tensors=(q, None))),
        ("float64 payload", _replace(none, tensors=(x.double(),))),
        ("fp16 as float32", _replace(fp16, tensors=(x,))),
        ("bf16 as float16", _replace(bf16, tensors=(x.half(),))),
        ("int8 as uint8", _replace(int8, tensors=(q.to(torch.uint8), scales))),
        ("float64 scales", _replace(int8, tensors=(q, scales.double()))),
        ("float32 scales", _replace(int8, tensors=(q, scales.float()))),
        ("int64 topk indices", _replace(topk, tensors=(idx.long(), vals))),
        ("float topk indices", _replace(topk, tensors=(idx.float(), vals))),
        ("payload shape", _replace(none, tensors=(x.reshape(32),))),
        ("int8 rows", _replace(int8, tensors=(q.reshape(8, 4), scales))),
        ("scales count", _replace(int8, tensors=(q, scales[:3]))),
        ("values count", _replace(topk, tensors=(idx, vals[:5]))),
        ("index past the end", with_index(-1, 32)),
        ("negative index", with_index(0, -1)),
        ("duplicate index", with_index(1, int(idx[0]))),
        (
            "k > numel",
            _replace(topk, tensors=(torch.arange(40, dtype=torch.int32), x.new_ones(40))),
        ),
        ("NaN scale", with_scale(math.nan)),
        ("negative scale", with_scale(-0.5)),
        ("inf scale", with_scale(math.inf)),
        ("scale whose q·scale overflows", with_scale(3e38)),
        ("q of -128", _replace(int8, tensors=(q_min, scales))),
        ("inf none payload", _replace(none, tensors=(inf_x,))),
        ("inf fp16 payload", _replace(fp16, tensors=(inf_x.half(),))),
        ("NaN bf16 payload", _replace(bf16, tensors=(torch.full((4, 8), math.nan).bfloat16(),))),
        ("NaN topk value", _replace(topk, tensors=(idx, nan_vals))),
        ("requires_grad", _replace(none, tensors=(x.clone().requires_grad_(),))),
        ("a Parameter", _replace(none, tensors=(torch.nn.Parameter(x, requires_grad=False),))),
        ("sparse payload", _replace(none, tensors=(x.to_sparse(),))),
        ("meta payload", _replace(none, tensors=(x.to("meta"),))),
    ]


@pytest.mark.parametrize(("what", "message"), _malformed(), ids=[w for w, _ in _malformed()])
def test_validate_rejects_malformed(what: str, message: object) -> None:
    reason = validate(message, (4, 8))
    assert isinstance(reason, str), what
    assert 0 < len(reason) < 200


_FUZZ_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]
_SPECIALS = [math.nan, math.inf, -math.inf, 3e38, -128, -1, 0, 7, 2**31 - 1, 1e-40]


def _random_shape(rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randint(0, 6) for _ in range(rng.randint(0, 3)))


def _random_tensor(rng: random.Random) -> Tensor:
    shape = _random_shape(rng)
    dtype = rng.choice(_FUZZ_DTYPES)
    if dtype.is_floating_point or dtype.is_complex:
        return (torch.randn(shape, dtype=torch.float64) * 10 ** rng.uniform(-5, 40)).to(dtype)
    return torch.randint(-200, 200, shape).to(dtype)


def _poke(rng: random.Random, t: Tensor) -> Tensor:
    """A copy of ``t`` with one element set to an awkward value (as the dtype casts it)."""
    if t.numel() == 0:
        return t
    t = t.clone(memory_format=torch.contiguous_format)
    value = rng.choice(_SPECIALS)
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        value = 0 if not math.isfinite(value) else int(max(min(value, 2**31 - 1), -(2**31)))
    t.view(-1)[rng.randrange(t.numel())] = torch.tensor(value).to(t.dtype)
    return t


def _mutate(rng: random.Random, encoded: Encoded) -> Any:
    old = encoded.tensors
    tensors = [t for t in old if isinstance(t, Tensor)] if isinstance(old, tuple | list) else []
    kind = rng.randrange(9)
    if not tensors:  # an earlier mutation removed them all
        tensors.append(_random_tensor(rng))
    if kind == 0:
        return _replace(encoded, codec=rng.choice([*GRADIENT_CODECS, "gzip", "", "INT8"]))
    if kind == 1:
        return _replace(encoded, shape=_random_shape(rng))
    if kind == 2:
        tensors[rng.randrange(len(tensors))] = _random_tensor(rng)
    elif kind == 3:
        tensors.append(_random_tensor(rng))
    elif kind == 4:
        tensors.pop(rng.randrange(len(tensors)))
    elif kind == 5:
        i = rng.randrange(len(tensors))
        tensors[i] = _poke(rng, tensors[i])
    elif kind == 6:
        i = rng.randrange(len(tensors))
        if tensors[i].dtype.is_floating_point:
            tensors[i] = tensors[i].clone().requires_grad_()
    elif kind == 7:
        return _replace(encoded, tensors=rng.choice([None, tensors, tensors[0], "abc", (1, 2)]))
    else:
        i = rng.randrange(len(tensors))
        tensors[i] = tensors[i].to(rng.choice(_FUZZ_DTYPES))
    return _replace(encoded, tensors=tuple(tensors))


def test_validate_fuzz_never_raises_and_accepted_messages_decode() -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    accepted = rejected = 0
    for _ in range(500):
        shape = _random_shape(rng)
        x = torch.randn(shape) * 10 ** rng.uniform(-3, 6)
        message: Any = encode(rng.choice(GRADIENT_CODECS), x, topk_ratio=rng.uniform(0.01, 1.0))
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            message = _mutate(rng, message)
        reason = validate(message, shape)
        if reason is None:
            accepted += 1
            y = decode(message)
            assert y.dtype == torch.float32
            assert tuple(y.shape) == shape
            assert bool(torch.isfinite(y).all())
        else:
            assert isinstance(reason, str)
            rejected += 1
    assert accepted > 100
    assert rejected > 100
