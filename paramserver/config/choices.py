"""The job's choices as ``Literal`` types, each with its values as a tuple: mypy checks what a
field is set to and what it is compared with (``config.mode == "sycn"`` is an error), and the
tuples give ``--help`` its choices and the checks their messages.

The update rules' names (:data:`paramserver.optimconfig.OptimizerName`) and the schedule's
decays (:data:`paramserver.schedule.Decay`) live with the code that defines them.
"""

from __future__ import annotations

import types
from typing import Any, Literal, Union, get_args, get_origin

Mode = Literal["async", "sync", "ssp"]
DenseSync = Literal["server", "allreduce"]
Launcher = Literal["auto", "processes", "torchrun", "threads"]
# The codecs' names, defined once (paramserver.wire.compression implements them): any for dense
# gradients (top-k with error feedback), the others for values, rows and pooled vectors.
GradientCodec = Literal["none", "fp16", "bf16", "int8", "topk"]
ValueCodec = Literal["none", "fp16", "bf16", "int8"]
PublishCodec = Literal["none", "bf16", "int8"]  # a change log's row values

MODES: tuple[Mode, ...] = get_args(Mode)
DENSE_SYNCS: tuple[DenseSync, ...] = get_args(DenseSync)
LAUNCHERS: tuple[Launcher, ...] = get_args(Launcher)
GRADIENT_CODECS: tuple[GradientCodec, ...] = get_args(GradientCodec)
VALUE_CODECS: tuple[ValueCodec, ...] = get_args(ValueCodec)
PUBLISH_CODECS: tuple[PublishCodec, ...] = get_args(PublishCodec)


def type_parts(hint: Any) -> tuple[Any, ...]:
    """The members of a resolved type hint: ``int | None`` is ``(int, NoneType)``, a
    ``Literal`` stays whole (``Mode | None`` is ``(Mode, NoneType)``)."""
    if get_origin(hint) in (Union, types.UnionType):
        return tuple(part for arg in get_args(hint) for part in type_parts(arg))
    return (hint,)


def choices_of(hint: Any) -> tuple[Any, ...] | None:
    """The values a ``Literal`` (or an optional one) allows; None for any other type."""
    for part in type_parts(hint):
        if get_origin(part) is Literal:
            return get_args(part)
    return None
