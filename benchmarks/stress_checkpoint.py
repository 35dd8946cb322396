"""Stress the checkpoint store: SIGKILL a committing writer at random moments, N times.

Each trial forks a writer that commits checkpoints (about 3.5 MB each, every tensor a function
of its step) into one shared root, waits for its first commit, kills it with SIGKILL after a
delay uniform in ``[0, --max-delay]`` s, then loads the newest checkpoint as a restarted job
would and checks it bit for bit (see checkpoint_writer.py). Prints JSON; ``failures``
must be 0. Usage:

    .venv/bin/python benchmarks/stress_checkpoint.py --trials 200
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from checkpoint_writer import WriterZygote, kill_trial


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200, help="writers to kill")
    parser.add_argument("--max-delay", type=float, default=0.3, help="seconds, after 1st commit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, help="checkpoint root (default: a temp directory)")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    kills = loads_ok = 0
    failures: list[str] = []
    steps: list[int] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="stress_checkpoint.") as scratch:
        root = args.root or Path(scratch)
        with WriterZygote() as zygote:
            for trial in range(args.trials):
                result = kill_trial(zygote, root, rng, max_delay=args.max_delay)
                kills += 1
                if result.ok:
                    loads_ok += 1
                    assert result.loaded_step is not None
                    steps.append(result.loaded_step)
                else:
                    failures.append(f"trial {trial}: {result.detail}")
    report = {
        "trials": args.trials,
        "kills": kills,
        "loads_valid": loads_ok,
        "failures": len(failures),
        "failure_details": failures[:10],
        "newest_step_loaded": max(steps, default=0),  # steps go on across writers
        "max_delay_s": args.max_delay,
        "seed": args.seed,
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(report, indent=2))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
