#!/usr/bin/env bash
# accelerate launch with a yaml from recipes/accelerate/ (DeepSpeed ZeRO-2 by default; ZeRO-3 or FSDP by
# ACCELERATE_CONFIG). The DeepSpeed JSON is named in the yaml.
#   NPROC=2 bash recipes/train_accelerate.sh --train_shards ... --output_dir ...
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/accelerate launch --config_file "${ACCELERATE_CONFIG:-recipes/accelerate/deepspeed_zero2.yaml}" \
  --num_processes "${NPROC:-2}" --main_process_port "${MASTER_PORT:-29500}" -m disco_clip_ds.train "$@"
