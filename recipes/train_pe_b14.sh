#!/usr/bin/env bash
# Perception Encoder's large-batch recipe (Bolya et al. 2025) at ViT-B/14 size: a 64K contrastive batch, LAMB at lr 2e-3,
# progressive resolution 98 -> 154 -> 224 px (PE's stages without its 336 px tail: the model is built at the last side).
# GPUS=64 (64 x 1024 a GPU) or GPUS=256 (256 x 256), with HOSTFILE naming the nodes; docs/training.md prints the plan of
# each (`disco-clip plan`, the same flags).
#   GPUS=64 SHARDS='/data/datacomp/{00000..12799}.tar' STEPS=... bash recipes/train_pe_b14.sh
set -euo pipefail
cd "$(dirname "$0")/.."
GPUS=${GPUS:-64}
case $GPUS in
  64) DS_CONFIG=ds_configs/pe_b14_64k_64gpu.json PER_GPU=1024 ;;
  256) DS_CONFIG=ds_configs/pe_b14_64k_256gpu.json PER_GPU=256 ;;
  *) echo "GPUS must be 64 or 256 (one DeepSpeed config each: ds_configs/pe_b14_64k_*gpu.json)" >&2; exit 2 ;;
esac
export DS_CONFIG NPROC=${NPROC:-8}
# LAMB (train/lamb.py: its trust ratio per parameter tensor, whatever ZeRO's partition) at PE's 2e-3, its betas and
# weight decay as the CLIP recipe's AdamW; the DeepSpeed config has no optimizer block (LAMB refuses one).
exec bash recipes/train_deepspeed.sh \
  --train_shards "${SHARDS:?set SHARDS to the img2dataset shards, e.g. /data/datacomp/{00000..12799}.tar}" \
  --model_config recipes/models/vit_b14.json --tokenizer_name openai/clip-vit-base-patch32 --loss_impl tiled \
  --output_dir "${OUT:-outputs/pe_b14_64k_${GPUS}gpu}" --per_device_train_batch_size "$PER_GPU" \
  --bf16 --activation_checkpointing \
  --optim lamb --learning_rate 2e-3 --adam_beta1 0.9 --adam_beta2 0.98 --adam_epsilon 1e-6 --weight_decay 0.05 \
  --max_grad_norm 0 --lr_scheduler_type cosine --warmup_steps 2000 ${STEPS:+--max_steps "$STEPS"} \
  --resolution_schedule 0:98,0.35:154,0.7:224 \
  --dataloader_num_workers "${WORKERS:-8}" --logging_steps 50 --save_steps 2000 \
  --resume_from_checkpoint latest "$@"
