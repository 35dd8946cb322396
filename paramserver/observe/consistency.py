"""The replica consistency check: a trainer's dense replica against the servers' values.

Every ``--consistency-every`` steps a trainer sends each server a checksum of each dense
parameter as its replica holds it; the server answers with its current version (updates
applied) and checksum, and its current value where the checksums differ. The trainer then
knows how many versions its replica is behind and how far apart the values are. A difference
at the same version means the replica is not what the server served: with a dense pull codec
that is the codec's rounding; without one, a fault.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from paramserver.wire.messages import ServerView


def checksum(tensor: Tensor) -> str:
    """A digest of the tensor's bytes (not of its dtype or shape)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(data.data, digest_size=16).hexdigest()


@dataclass
class Divergence:
    """One check of one trainer's replica (every dense parameter)."""

    versions_behind_max: int = 0
    versions_behind_mean: float = 0.0
    max_abs_diff: float = 0.0  # largest |replica - server| over all values
    rel_l2_diff: float = 0.0  # ||replica - server|| / ||server||, over all values
    differing: int = 0  # parameters whose checksums differ
    differing_at_same_version: int = 0

    def as_record(self) -> dict[str, float]:
        return {k: float(v) for k, v in vars(self).items()}


def compare(
    replica: dict[str, Tensor], versions: dict[str, int], servers: dict[str, ServerView]
) -> Divergence:
    """The divergence of ``replica`` (pulled at ``versions``) from the servers' ``servers``."""
    result = Divergence()
    behind = [servers[name].version - versions[name] for name in replica]
    result.versions_behind_max = max(behind, default=0)
    result.versions_behind_mean = sum(behind) / len(behind) if behind else 0.0
    diff_sq = norm_sq = 0.0
    for name, value in replica.items():
        value = value.detach()
        view = servers[name]
        if view.value is None:
            norm_sq += float(value.double().square().sum())
            continue
        result.differing += 1
        result.differing_at_same_version += int(view.version == versions[name])
        diff = value.double() - view.value.double()
        result.max_abs_diff = max(
            result.max_abs_diff, float(diff.abs().max()) if diff.numel() else 0.0
        )
        diff_sq += float(diff.square().sum())
        norm_sq += float(view.value.double().square().sum())
    result.rel_l2_diff = (diff_sq / norm_sq) ** 0.5 if norm_sq else 0.0
    return result


def summarize_checks(checks: list[Divergence]) -> dict[str, float]:
    """A trainer's checks over the job, for its report."""
    if not checks:
        return {}
    return {
        "checks": len(checks),
        "versions_behind_max": max(c.versions_behind_max for c in checks),
        "versions_behind_mean": sum(c.versions_behind_mean for c in checks) / len(checks),
        "max_abs_diff": max(c.max_abs_diff for c in checks),
        "rel_l2_diff_max": max(c.rel_l2_diff for c in checks),
        "differing_at_same_version": sum(c.differing_at_same_version for c in checks),
    }


def merge_checks(summaries: list[dict[str, float]]) -> dict[str, float]:
    """Trainers' check summaries as one (empty without checks)."""
    if not summaries:
        return {}
    checks = sum(s["checks"] for s in summaries)
    return {
        "checks": checks,
        "versions_behind_max": max(s["versions_behind_max"] for s in summaries),
        "versions_behind_mean": sum(s["versions_behind_mean"] * s["checks"] for s in summaries)
        / checks,
        "max_abs_diff": max(s["max_abs_diff"] for s in summaries),
        "rel_l2_diff_max": max(s["rel_l2_diff_max"] for s in summaries),
        "differing_at_same_version": sum(s["differing_at_same_version"] for s in summaries),
    }
