"""Integer hashing shared by every layer: SplitMix64's finalizer on int64 ids.

Routing a dynamic table's ids to servers (:mod:`paramserver.sharding`), seeding a new row's
initial values (:mod:`paramserver.store.dynamic`) and hashing Criteo's categorical strings
(:mod:`paramserver.data.criteo`) all need a well-spread, reproducible hash of int64 values that
does not depend on the process (Python's ``hash`` of a str does). All arithmetic wraps at 64
bits, as numpy's int64 does.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

GOLDEN_GAMMA = -7046029254386353131  # 0x9E3779B97F4A7C15 (2^64 / phi) as a signed int64
_MIX_2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX_3 = -7723592293110705685  # 0x94D049BB133111EB


def mix64(values: Tensor) -> Tensor:
    """SplitMix64's finalizer on int64 tensors (wrapping arithmetic): a well-spread hash."""
    return torch.from_numpy(mix64_array(values.numpy()))


def mix64_array(x: np.ndarray) -> np.ndarray:
    """:func:`mix64` on an int64 numpy array."""
    x = x + np.int64(GOLDEN_GAMMA)
    x = (x ^ _shift_right(x, 30)) * np.int64(_MIX_2)
    x = (x ^ _shift_right(x, 27)) * np.int64(_MIX_3)
    return x ^ _shift_right(x, 31)


def _shift_right(x: np.ndarray, bits: int) -> np.ndarray:
    """Logical right shift of int64 values (``>>`` is arithmetic on signed ints)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64_in_place(x: np.ndarray, scratch: np.ndarray) -> None:
    """:func:`mix64_array` on a uint64 array, in place: the same bits as on its int64 view,
    without temporaries (``scratch``, of its shape and dtype, is overwritten), for large
    arrays. uint64's ``>>`` is the logical shift."""
    x += np.uint64(GOLDEN_GAMMA % 2**64)
    for bits, multiplier in ((30, _MIX_2), (27, _MIX_3)):
        np.right_shift(x, np.uint64(bits), out=scratch)
        x ^= scratch
        x *= np.uint64(multiplier % 2**64)
    np.right_shift(x, np.uint64(31), out=scratch)
    x ^= scratch
