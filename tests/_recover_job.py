"""Run tests/test_recover_kill.py's job with ``--recover`` under torchrun; the chief writes the
summary.

``torchrun ... tests/_recover_job.py ROOT MODE`` (with the repository on ``PYTHONPATH``): every
rank runs this; the job's log, checkpoints and ``summary.json`` go under ``ROOT``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import paramserver as ps
from tests.helpers import TinyRecModel, mse
from tests.test_recover_kill import job_config, slow_data

if __name__ == "__main__":
    root, mode = Path(sys.argv[1]), sys.argv[2]
    config = job_config(root, mode, recover=True, restarts=1).replace(launcher="torchrun")
    result = ps.train(TinyRecModel, slow_data, mse, config)
    if result is not None:
        (root / "summary.json").write_text(json.dumps(result.summary))
