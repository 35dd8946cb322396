"""Writing a benchmark's results: JSON to a file, and to stdout unless told otherwise; and the
record of the machine they were measured on."""

from __future__ import annotations

import json
import os
import platform
from typing import Any

import torch


def machine() -> dict[str, Any]:
    """What ran the benchmark, each field named for what it counts: the CPUs the OS has
    (``logical_cpus``), those this process may run on (``usable_cpus``, its affinity mask: a
    container or taskset may allow fewer), and the intra-op threads torch uses in this process
    (``torch_threads``, often set to 1 by a benchmark)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def save(results: dict[str, Any], path: str, *, echo: bool = True) -> None:
    text = json.dumps(results, indent=2)
    if echo:
        print(text)
    with open(path, "w") as f:
        f.write(text + "\n")
