"""``python -m rocketstore.spark JOB ...``: the same as ``rocketstore spark JOB ...``."""

import sys

from .cli import main

sys.exit(main())
