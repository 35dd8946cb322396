"""Where a job's start-up goes: the chief trainer's phases from the command to its first step.

Each phase ends at a mark this process makes (:func:`mark`) and begins where the one before it
ended; the first begins when the command started: the launcher's process, whose start time
the local launcher hands its workers (``PARAMSERVER_COMMAND_STARTED_AT``), or this process's
own. Times are wall-clock seconds (``time.time()``), comparable between processes of one
machine. The phases, in order:

- ``launch``: the command's own start-up (its interpreter, imports, checks of the model)
  until this process was started;
- ``interpreter``: this process's interpreter and imports (torch's among them) until it
  begins its role;
- ``rendezvous``: joining the RPC world (every process of the job must be up);
- ``model``: building the model, its plan and replica, and meeting the servers;
- ``first_step``: the first training step, its pull included.

Under the threads launcher (one process) the first trainer to reach a mark makes it.
"""

from __future__ import annotations

import os
import time

PHASES = ("launch", "interpreter", "rendezvous", "model", "first_step")
COMMAND_STARTED_AT = "PARAMSERVER_COMMAND_STARTED_AT"

_marks: dict[str, float] = {}


def process_started_at() -> float:
    """When this process started (wall clock): from ``/proc/self/stat`` where there is one,
    else when this module was first imported."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime: field 22, clock ticks after boot
        since_boot = ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()


def command_started_at() -> float:
    """When the job's command started: the launcher's word, else this process's start."""
    given = os.environ.get(COMMAND_STARTED_AT)
    try:
        return float(given) if given is not None else process_started_at()
    except ValueError:
        return process_started_at()


def mark(phase: str) -> None:
    """``phase`` (one of :data:`PHASES` after ``launch``) has ended now, unless it already
    had in this process."""
    if phase not in PHASES:
        raise ValueError(f"no start-up phase {phase!r}")
    _marks.setdefault(phase, time.time())


def startup_seconds() -> dict[str, float | None]:
    """Each phase's seconds (None: not reached, or its end is unknown) and ``total`` (the
    command's start to the last phase reached), for the job summary."""
    ends = {"launch": process_started_at(), **_marks}
    seconds: dict[str, float | None] = {}
    begun = command_started_at()
    for phase in PHASES:
        end = ends.get(phase)
        seconds[phase] = None if end is None else max(0.0, end - begun)
        begun = end if end is not None else begun
    seconds["total"] = max(0.0, begun - command_started_at())
    return seconds
