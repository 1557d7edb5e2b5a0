#!/usr/bin/env bash
# torchrun: NPROC ranks per node; several nodes with NNODES/NODE_RANK/MASTER_ADDR (run it on every node).
# DS_CONFIG= (empty) trains with plain DDP instead of DeepSpeed.
#   NPROC=2 bash recipes/train_torchrun.sh --train_shards ... --output_dir ...
set -euo pipefail
cd "$(dirname "$0")/.."
DS_CONFIG=${DS_CONFIG-ds_configs/cpu_zero2.json}
.venv/bin/disco-clip node-check --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}"  # torchrun would wait forever
# restarts (--max_restarts) across nodes hang through torch's shared rendezvous store (pytorch/pytorch#135712)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
exec .venv/bin/torchrun --nproc_per_node "${NPROC:-2}" --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
  --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" -m disco_clip_ds.train \
  ${DS_CONFIG:+--deepspeed "$DS_CONFIG"} "$@"
