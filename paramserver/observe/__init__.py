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
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # the figure is in kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
