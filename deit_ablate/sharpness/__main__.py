"""`python -m deit_ablate.sharpness <run folder>`: measure a finished run (cli.py)."""

import sys

from deit_ablate.sharpness.cli import main

sys.exit(main())
