"""`python -m disco_clip_ds.plan`: the same command as `disco-clip plan`."""

import sys

from disco_clip_ds.errors import run_main
from disco_clip_ds.plan.report import main

sys.exit(run_main(main, None, "disco-clip plan"))
