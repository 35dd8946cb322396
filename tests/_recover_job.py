"""Run the recovery tests' job with ``--recover`` under torchrun; the chief writes the
summary.

``torchrun ... tests/_recover_job.py ROOT MODE`` (with the repository on ``PYTHONPATH``): every
rank runs this; the job's log, checkpoints and ``summary.json`` go under ``ROOT``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import paramserver as ps
from tests.helpers import TinyRecModel, mse, recover_job_config, slow_tiny_batches

if __name__ == "__main__":
    root, mode = Path(sys.argv[1]), sys.argv[2]
    config = recover_job_config(root, mode, recover=True, restarts=1).replace(launcher="torchrun")
    result = ps.train(TinyRecModel, slow_tiny_batches, mse, config)
    if result is not None:
        (root / "summary.json").write_text(json.dumps(result.summary))
