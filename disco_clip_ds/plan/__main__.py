"""`python -m disco_clip_ds.plan`: the same command as `disco-clip plan`, through the same dispatch (cli.py), so
that this room imports nothing of commands/."""

import sys

from disco_clip_ds.cli import main

sys.exit(main(["plan", *sys.argv[1:]]))
