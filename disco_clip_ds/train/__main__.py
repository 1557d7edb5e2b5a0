"""`python -m disco_clip_ds.train`: what every launcher runs (deepspeed --module, torchrun -m, accelerate launch -m).

An entry point, like cli.py: it runs the `disco-clip train` command (the one module of train/ that imports
commands/)."""

import sys

from disco_clip_ds.commands.train import main
from disco_clip_ds.errors import run_main

sys.exit(run_main(main, None, "disco-clip train"))
