"""Observability: call profiles, the run directory's metric records, and reports of a run."""

from __future__ import annotations

import resource
import sys


def peak_rss_bytes() -> int:
    """This process's peak resident memory: ``VmHWM`` of ``/proc/self/status`` where there is
    one (Linux), else ``ru_maxrss`` (KiB on Linux, bytes on macOS).

    Not ``ru_maxrss`` on Linux: a process started by fork and exec inherits the peak of the
    process it was forked from (the kernel keeps the larger of the two across exec), so every
    worker of a launcher would report at least the launcher's peak."""
    peak = proc_kib("/proc/self/status", "VmHWM")
    if peak is not None:
        return peak * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def proc_kib(path: str, key: str) -> int | None:
    """The figure in kB of line ``key:`` of a ``/proc`` file (``/proc/meminfo``'s
    ``MemAvailable``, say); None where the file or the line is missing."""
    try:
        with open(path) as lines:
            for line in lines:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None
