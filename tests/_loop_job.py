"""Run the two-task user loop of tests/helpers.py under torchrun; the chief writes what it got.

``torchrun ... tests/_loop_job.py OUT.pt`` (with the repository on ``PYTHONPATH``): every rank
runs this. Used by tests/test_loop.py.
"""

from __future__ import annotations

import sys

import torch

from tests.helpers import two_task_job

if __name__ == "__main__":
    output = two_task_job("torchrun")
    if output:
        torch.save(output, sys.argv[1])
