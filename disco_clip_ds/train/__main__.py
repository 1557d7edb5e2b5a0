"""`python -m disco_clip_ds.train`: what every launcher runs (deepspeed --module, torchrun -m, accelerate launch -m)."""

import sys

from disco_clip_ds.errors import run_main
from disco_clip_ds.train.run import main

sys.exit(run_main(main, None, "disco-clip train"))
