"""`disco-clip train` / `python -m disco_clip_ds.train`: CLIP under the HF Trainer (+ DeepSpeed ZeRO) with the
distributed contrastive loss computed inside the model's forward.

Starts the same way under every launcher (`deepspeed`, `torchrun`, `accelerate launch`, or plain python); on a
machine without a GPU it runs on CPU with no extra flag. Arguments: the Trainer's own (`--help` lists them) plus
`disco_clip_ds.train.args`' ModelArguments and DataArguments.

A stop signal during start-up ends the rank with one line and exit code 75 (`distributed/startup.py`): its watch is
installed first, before torch is imported, so this module imports the rest inside `main`.
"""

from __future__ import annotations

import logging
import os
import sys

from disco_clip_ds.distributed import startup


def main(argv: list[str] | None = None) -> int:
    """`disco-clip train`: parse the arguments, validate them, train. Errors are raised (`errors.run_main` turns
    them into a message and an exit code)."""
    startup.watch_startup("disco-clip train")  # until the trainer's StopOnSignal takes over
    from disco_clip_ds import compat
    from disco_clip_ds.distributed.preemption import exit_without_finalization
    from disco_clip_ds.train.args import parse_args
    from disco_clip_ds.train.run import train

    compat.quiet_default_config_warnings()  # SigLIP's every config repr and save would warn about transformers' ids
    startup.cpu_accelerator_when_no_gpu()  # before DeepSpeed looks for one (TrainingArguments' device set-up)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    try:
        model_args, data_args, args = parse_args(argv)
        startup.at_startup_point()  # DISCO_FAULT signal_at_startup: the process group is joined, nothing checked
        # as HF's run_clip: the main process logs at INFO, the others at --log_level_replica (WARNING by default)
        logging.getLogger().setLevel(logging.INFO if args.should_log else args.get_process_log_level())
        train(model_args, data_args, args)
        return 0
    finally:
        startup.end_startup()  # a run that ended before its trainer took over (in-process: the caller's handlers)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a launched rank: the process ends after this
            compat.destroy_process_group()
            error = sys.exc_info()[1]
            exit_without_finalization(0 if error is None else getattr(error, "exit_code", 1))
