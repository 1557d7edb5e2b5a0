#!/usr/bin/env bash
# DeepSpeed's own launcher. One node: NPROC ranks (GPUs, or CPU ranks where there is no GPU). Several nodes:
# HOSTFILE=recipes/hostfile.example (one line per node, "host slots=GPUs"; passwordless ssh between nodes).
#   DS_CONFIG=ds_configs/cpu_zero2.json NPROC=2 bash recipes/train_deepspeed.sh --train_shards ... --output_dir ...
set -euo pipefail
cd "$(dirname "$0")/.."
DS_CONFIG=${DS_CONFIG:-ds_configs/cpu_zero2.json}
if [ -n "${HOSTFILE:-}" ]; then
  .venv/bin/disco-clip node-check --hostfile "$HOSTFILE"  # one line for a bad line, not deepspeed's traceback
  where=(--hostfile "$HOSTFILE" --master_addr "${MASTER_ADDR:?set MASTER_ADDR to the first host}")
else
  where=(--num_gpus "${NPROC:-2}")
fi
exec .venv/bin/deepspeed "${where[@]}" --master_port "${MASTER_PORT:-29500}" --module disco_clip_ds.train \
  --deepspeed "$DS_CONFIG" "$@"
