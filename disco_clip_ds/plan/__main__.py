"""`python -m disco_clip_ds.plan`: the same command as `disco-clip plan`."""

import sys

from ..errors import run_main
from .report import main

sys.exit(run_main(main, None, "disco-clip plan"))
