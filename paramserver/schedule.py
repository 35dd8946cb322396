"""Learning-rate schedules: the factor of a group's base lr at each training step.

A schedule follows the convention of ``torch.optim.lr_scheduler.LambdaLR``: a function of the
step ``s = 0, 1, 2, ...`` returning a factor, and the update of step ``s`` is applied with
``lr = base_lr * factor(s)``; the first update sees step 0. Each group has one: the dense
parameters (group ``"dense"``) and each embedding table (its name).

Which step an update sees (servers apply it; see ``Coordinator``): step ``s`` is a trainer's
``s``-th training step counted from 0, whose gradients were computed from the values its call
``s`` read (``PushPullRequest.grads_call``; with or without prefetch, call ``s`` is the pull of
step ``s``). In sync mode the round that call ``s + 1`` closes applies every trainer's step-``s``
gradients, at step ``s``. In async and ssp modes each push is applied at its own trainer's step,
so trainers at different steps apply different rates. A resumed job's call numbers continue
from its checkpoint, and so does the schedule.

The built-in :class:`Schedule` (flags ``--lr-warmup-steps``, ``--lr-decay``,
``--lr-decay-steps``, ``--lr-decay-rate``, ``--lr-min``, ``--lr-min-ratio``), with warm-up
``W``, decay steps ``D``, rate ``r`` and floor ``f`` (``lr_min / base_lr``, or ``lr_min_ratio``;
0 unless given):

- warm-up, ``s < W``: ``(s + 1) / W`` (not floored: step ``W - 1`` reaches the full lr);
- then, with ``t = s - W``, per decay:

  - ``none``: 1;
  - ``linear``: ``f + (1 - f) * max(0, 1 - t / D)``, from 1 down to ``f`` at ``t = D``;
  - ``cosine``: ``f + (1 - f) * (1 + cos(pi * min(t, D) / D)) / 2``, the same ends;
  - ``exponential``: ``max(f, r ** (t / D))`` (TensorFlow's ``exponential_decay``);
  - ``step``: ``max(f, r ** floor(t / D))`` (its ``staircase=True``): ``r`` every ``D`` steps.

Pure functions of the step: a trainer computes the rate it reports without asking a server.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Real
from typing import Literal, get_args

from paramserver.errors import ConfigError

Decay = Literal["none", "linear", "cosine", "exponential", "step"]
DECAYS: tuple[Decay, ...] = get_args(Decay)
DEFAULT_DECAY_RATE = 0.1

LrSchedule = Callable[[int], float]
"""A function of the step (0 for the first update) returning a factor of the base lr."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """The built-in schedule (see the module docstring for its formulas). Values are checked
    when it is made, with a :class:`ConfigError` naming the flag (and the TOML key)."""

    warmup_steps: int = 0
    decay: Decay = "none"
    decay_steps: int | None = None
    decay_rate: float | None = None  # exponential and step only; None: 0.1
    min_lr: float | None = None  # the floor as an lr ...
    min_ratio: float | None = None  # ... or as a ratio of the base lr; at most one

    def __post_init__(self) -> None:
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise ConfigError(
                f"--lr-warmup-steps (lr_warmup_steps) must be an integer >= 0, got "
                f"{self.warmup_steps!r}"
            )
        if self.decay not in DECAYS:
            raise ConfigError(
                f"--lr-decay (lr_decay): unknown decay {self.decay!r}; choose from {DECAYS}"
            )
        self._check_decay_steps()
        self._check_rate()
        self._check_floor()

    def _check_decay_steps(self) -> None:
        if self.decay == "none":
            if self.decay_steps is not None:
                raise ConfigError("--lr-decay-steps (lr_decay_steps) needs --lr-decay")
            return
        if not _is_int(self.decay_steps) or self.decay_steps < 1:  # type: ignore[operator]
            raise ConfigError(
                f"--lr-decay {self.decay} needs --lr-decay-steps (lr_decay_steps), an integer "
                f">= 1, got {self.decay_steps!r}"
            )

    def _check_rate(self) -> None:
        if self.decay_rate is None:
            return
        if self.decay not in ("exponential", "step"):
            raise ConfigError(
                "--lr-decay-rate (lr_decay_rate) is for --lr-decay exponential or step, not "
                f"{self.decay}"
            )
        if not _is_number(self.decay_rate) or not 0 < self.decay_rate <= 1:
            raise ConfigError(
                f"--lr-decay-rate (lr_decay_rate) must be in (0, 1], got {self.decay_rate!r}"
            )

    def _check_floor(self) -> None:
        if self.min_lr is None and self.min_ratio is None:
            return
        if self.min_lr is not None and self.min_ratio is not None:
            raise ConfigError(
                "--lr-min (lr_min) and --lr-min-ratio (lr_min_ratio) both set the floor: give one"
            )
        if self.decay == "none":
            raise ConfigError("--lr-min and --lr-min-ratio (lr_min, lr_min_ratio) need --lr-decay")
        if self.min_lr is not None and (
            not _is_number(self.min_lr) or not 0 <= self.min_lr < math.inf
        ):
            raise ConfigError(f"--lr-min (lr_min) must be a number >= 0, got {self.min_lr!r}")
        if self.min_ratio is not None and (
            not _is_number(self.min_ratio) or not 0 <= self.min_ratio <= 1
        ):
            raise ConfigError(
                f"--lr-min-ratio (lr_min_ratio) must be in [0, 1], got {self.min_ratio!r}"
            )

    def check_base_lr(self, base_lr: float) -> None:
        """Refuse an absolute floor above the base lr it applies to."""
        if self.min_lr is not None and self.min_lr > base_lr:
            raise ConfigError(f"--lr-min (lr_min) {self.min_lr} exceeds the lr {base_lr}")

    def floor(self, base_lr: float) -> float:
        """The floor as a factor of ``base_lr``."""
        if self.min_lr is not None:
            return self.min_lr / base_lr
        return self.min_ratio if self.min_ratio is not None else 0.0

    def factor(self, step: int, base_lr: float) -> float:
        """The factor of ``base_lr`` at ``step`` (0 for the first update; a negative step is
        taken as 0)."""
        step = max(int(step), 0)
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "none":
            return 1.0
        assert self.decay_steps is not None  # checked when made
        t, d, floor = step - self.warmup_steps, self.decay_steps, self.floor(base_lr)
        if self.decay == "linear":
            return floor + (1 - floor) * max(0.0, 1 - t / d)
        if self.decay == "cosine":
            return floor + (1 - floor) * (1 + math.cos(math.pi * min(t, d) / d)) / 2
        rate = DEFAULT_DECAY_RATE if self.decay_rate is None else self.decay_rate
        exponent = t / d if self.decay == "exponential" else t // d
        return max(floor, rate**exponent)


def checked_factor(schedule: LrSchedule, step: int, group: str) -> float:
    """``schedule(step)`` as a float, or a :class:`ConfigError` naming the step and the group
    if it raises or returns anything but a finite number >= 0."""
    try:
        value = schedule(step)
    except Exception as error:
        raise ConfigError(
            f"lr_schedule of {group!r} raised at step {step}: {type(error).__name__}: {error}"
        ) from error
    if not _is_number(value) or not 0 <= float(value) < math.inf:
        raise ConfigError(
            f"lr_schedule of {group!r} returned {value!r} at step {step}: a factor of the base "
            "lr must be a finite number >= 0"
        )
    return float(value)
