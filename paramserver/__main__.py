"""``python -m paramserver`` (what torchrun runs with ``-m paramserver``)."""

import sys

from paramserver.cli import main

sys.exit(main())
