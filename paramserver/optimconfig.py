"""The settings of an update rule: the optimizer, its hyper-parameters (torch.optim's names and
defaults) and its learning-rate schedule, as the job gives them for the dense parameters and
for each table (:class:`OptimizerConfig`); and every group's learning rate at a step
(:class:`LearningRates`). TrainConfig's optim section (:class:`paramserver.config.OptimSection`)
makes them from its flags; servers and trainers read them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from paramserver.errors import ConfigError
from paramserver.schedule import DECAYS, Decay, LrSchedule, Schedule, checked_factor

OptimizerName = Literal["sgd", "adagrad", "rowwise_adagrad", "adam"]
OPTIMIZERS: tuple[OptimizerName, ...] = get_args(OptimizerName)
BUILTIN_SCHEDULE_KEYS = ("warmup_steps", "decay", "decay_steps", "decay_rate", "min", "min_ratio")


def builtin_schedule_keys(settings: Any) -> dict[str, Any]:
    """The built-in schedule's keys of ``settings`` (an OptimizerConfig or an OptimSection: their
    ``lr_*`` fields), as :class:`Schedule` names them (``lr_`` dropped)."""
    return {key: getattr(settings, f"lr_{key}") for key in BUILTIN_SCHEDULE_KEYS}


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """A server-side update rule and its hyper-parameters (torch.optim's names and defaults),
    with its learning-rate schedule: the built-in's keys (``lr_warmup_steps``, ``lr_decay``,
    ``lr_decay_steps``, ``lr_decay_rate``, ``lr_min``, ``lr_min_ratio``, as TrainConfig's) or
    ``lr_schedule``; a table's rule that sets none of them takes the job's schedule."""

    name: OptimizerName = "adagrad"
    lr: float = 0.01
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float | None = None
    adagrad_lr_decay: float = 0.0  # torch Adagrad's lr_decay (was lr_decay here)
    initial_accumulator_value: float = 0.0
    # The learning-rate schedule (paramserver.schedule): the built-in's keys, or lr_schedule,
    # a function of the step returning a factor of lr. None: not set (a table's rule then
    # takes the job's schedule, see OptimSection.table_optimizer_for).
    lr_warmup_steps: int | None = None
    lr_decay: Decay | None = None
    lr_decay_steps: int | None = None
    lr_decay_rate: float | None = None
    lr_min: float | None = None
    lr_min_ratio: float | None = None
    lr_schedule: LrSchedule | None = None

    def __post_init__(self) -> None:
        self._check_rule()
        self._check_schedule()

    def _check_rule(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ConfigError(
                f"--optimizer: unknown optimizer {self.name!r}; choose from {OPTIMIZERS}"
            )
        if not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        if self.momentum < 0 or self.weight_decay < 0:
            raise ConfigError("--momentum and --weight-decay must be >= 0")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError("nesterov needs momentum > 0 and dampening 0")
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"betas must lie in [0, 1), got {self.betas}")
        if self.eps is not None and self.eps <= 0:
            raise ConfigError(f"eps must be > 0, got {self.eps}")
        if self.name == "rowwise_adagrad" and self.adagrad_lr_decay:
            raise ConfigError("rowwise_adagrad has no adagrad_lr_decay; remove it or use adagrad")

    def _check_schedule(self) -> None:
        refuse_numeric_lr_decay(self.lr_decay)
        if self.lr_schedule is None:
            self.builtin_schedule.check_base_lr(self.lr)
            return
        if not callable(self.lr_schedule):
            raise ConfigError(
                f"lr_schedule must be a function of the step (Python only), got "
                f"{self.lr_schedule!r}; a TOML file sets the built-in schedule's keys"
            )
        given = [f"lr_{k}" for k, v in self._builtin_keys().items() if v is not None]
        if given:
            raise ConfigError(f"lr_schedule and {', '.join(given)} both set a schedule: give one")

    def _builtin_keys(self) -> dict[str, Any]:
        return builtin_schedule_keys(self)

    @property
    def sets_schedule(self) -> bool:
        """Whether any schedule key is set here (else a table's rule takes the job's)."""
        return self.lr_schedule is not None or any(
            v is not None for v in self._builtin_keys().values()
        )

    @functools.cached_property  # made once (a frozen dataclass keeps it in its __dict__)
    def builtin_schedule(self) -> Schedule:
        """The built-in schedule of these keys (unset ones at their defaults: no warm-up, no
        decay); the constant factor 1 when none is set."""
        return Schedule(
            warmup_steps=0 if self.lr_warmup_steps is None else self.lr_warmup_steps,
            decay="none" if self.lr_decay is None else self.lr_decay,
            decay_steps=self.lr_decay_steps,
            decay_rate=self.lr_decay_rate,
            min_lr=self.lr_min,
            min_ratio=self.lr_min_ratio,
        )

    def lr_factor(self, step: int, group: str = "") -> float:
        """The factor of ``lr`` at training step ``step`` (0 for the first update; see
        :mod:`paramserver.schedule` for which step an update sees): ``lr_schedule(step)``,
        checked (a ConfigError naming ``group`` and the step), or the built-in's."""
        if self.lr_schedule is not None:
            return checked_factor(self.lr_schedule, step, group)
        return self.builtin_schedule.factor(step, self.lr)

    def lr_at(self, step: int, group: str = "") -> float:
        """The learning rate the update of training step ``step`` is applied with."""
        return self.lr * self.lr_factor(step, group)

    @property
    def resolved_eps(self) -> float:
        if self.eps is not None:
            return self.eps
        return 1e-8 if self.name == "adam" else 1e-10

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str) -> OptimizerConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ConfigError(
                f"{where}: unknown optimizer keys {sorted(unknown)}; known: {sorted(known)}"
            )
        values = dict(values)
        if "betas" in values:
            values["betas"] = tuple(values["betas"])
        try:
            return cls(**values)
        except ConfigError as error:
            raise ConfigError(f"{where}: {error}") from None


def refuse_numeric_lr_decay(value: object) -> None:
    """``lr_decay`` names the schedule's decay; torch Adagrad's per-step decay, which it
    named before, is ``adagrad_lr_decay``: a number there is refused saying so."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        raise ConfigError(
            f"lr_decay = {value!r}: lr_decay is the learning-rate schedule's decay, one of "
            f"{DECAYS}; torch Adagrad's per-step decay (a number) is now adagrad_lr_decay"
        )


@dataclass(frozen=True, kw_only=True)
class LearningRates:
    """The rule of every group, for the learning rate each applies at a training step:
    ``dense`` (the dense parameters'), ``own`` (tables with their own rule) and ``default``
    (every other table's)."""

    dense: OptimizerConfig
    own: Mapping[str, OptimizerConfig]
    default: OptimizerConfig

    def at(self, step: int, tables: Iterable[str]) -> dict[str, float]:
        """The lr of ``"dense"`` and of each of ``tables`` at training step ``step``."""
        lrs = {"dense": self.dense.lr_at(step, "dense")}
        for table in tables:
            lrs[table] = self.own.get(table, self.default).lr_at(step, table)
        return lrs
