"""`python -m disco_clip_ds.train`: what every launcher runs (deepspeed --module, torchrun -m, accelerate launch -m).
The same command as `disco-clip train`, through the same dispatch (cli.py), so that this room imports nothing of
commands/."""

import sys

from disco_clip_ds.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
