#!/usr/bin/env bash
# The main job on the embedded default, on a fresh machine: set up .venv, build the offline digits demo
# dataset, train the tiny CLIP under DeepSpeed ZeRO-2 on 2 CPU ranks with the tiled global-batch loss (a few
# minutes), and print where the model and the logs are. LOSS=sigmoid trains the tiny SigLIP with its sigmoid loss;
# LOSS=siglip2 the tiny SigLIP 2 with NaFlex inputs (each image at its aspect ratio within MAX_NUM_PATCHES, default 16: the CLIP quickstart's tokens per image).
# DATA_FORMAT=hf builds the same demo as a 🤗 datasets parquet dataset and trains and evaluates from that.
# PATCH_DROPOUT=0.5 trains with FLIP's patch dropout (half of each image's patches dropped; eval sees them all);
# PATCH_DROPOUT_UNTIL_STEP=250 then sees every patch from step 250 on (FLIP's unmasked tuning).
# TEACHER=outputs/quickstart distils that trained model into this one (DISTILL_WEIGHT, default 0.5; DISTILL_TEMPERATURE,
# default the teacher's own logit scale; docs/distillation.md);
# MODEL=recipes/models/tiny_student.json trains a smaller student (1 layer, width 32 per tower).
# EMA_DECAY=0.99 keeps an EMA of the weights and evaluates it beside them (zeroshot_ema_*; docs/training.md, "EMA").
# OPTIM=lamb LR=2e-3 trains with LAMB at Perception Encoder's rate (docs/training.md, "LAMB"; default AdamW at 1e-3).
# RESOLUTION_SCHEDULE=0:32,0.35:48,0.7:64 trains at 32 px, then 48, then 64 (progressive resolution, as Perception Encoder;
# docs/training.md); the model is evaluated and saved at the last size.
# CAPTION_NOISE=0.3 builds and trains on the demo with 30 % of its training captions naming another digit
# (DATA=data/demo_noise0.3; noisy web captions, where a teacher has most to teach: docs/distillation.md).
#   bash recipes/quickstart.sh            # env: NPROC=2 STEPS=300 PER_RANK=128 SEED=0 DATA=data/demo OUT=outputs/quickstart
#   LOSS=sigmoid bash recipes/quickstart.sh   # OUT=outputs/quickstart_sigmoid
#   LOSS=siglip2 MAX_NUM_PATCHES=256 bash recipes/quickstart.sh   # OUT=outputs/quickstart_siglip2
#   DATA_FORMAT=hf bash recipes/quickstart.sh   # DATA=data/demo_hf OUT=outputs/quickstart_hf (VENV=.venv too)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 NO_ALBUMENTATIONS_UPDATE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread per rank: the ranks share the cores
# without a GPU, DS_ACCELERATOR=cpu says so to DeepSpeed, which would warn in each process that it found none
command -v nvidia-smi >/dev/null 2>&1 || export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
export no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}" NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}"
NPROC=${NPROC:-2} STEPS=${STEPS:-300} PER_RANK=${PER_RANK:-128} SEED=${SEED:-0} PATCH_DROPOUT=${PATCH_DROPOUT:-0}
LOSS=${LOSS:-softmax} DATA_FORMAT=${DATA_FORMAT:-shards} CAPTION_NOISE=${CAPTION_NOISE:-0}
NOISE=""; [ "$CAPTION_NOISE" = 0 ] || NOISE=_noise$CAPTION_NOISE
case "$DATA_FORMAT" in
  shards) DATA=${DATA:-data/demo$NOISE}; BUILT="$DATA/train/sizes.json"; FMT="" ;;
  hf) DATA=${DATA:-data/demo_hf$NOISE}; BUILT="$DATA/eval/zeroshot_classification_templates.txt"; FMT=_hf ;;
  *) echo "DATA_FORMAT=$DATA_FORMAT: shards (webdataset tar shards) or hf (a datasets parquet dataset)" >&2; exit 2 ;;
esac
case "$LOSS" in
  softmax) MODEL=${MODEL:-recipes/models/tiny.json}; OUT=${OUT:-outputs/quickstart${TEACHER:+_distilled}$NOISE$FMT} ;;
  sigmoid) MODEL=${MODEL:-recipes/models/siglip_tiny.json}; OUT=${OUT:-outputs/quickstart_sigmoid${TEACHER:+_distilled}$NOISE$FMT} ;;
  siglip2) MODEL=${MODEL:-recipes/models/siglip2_tiny.json}; OUT=${OUT:-outputs/quickstart_siglip2${TEACHER:+_distilled}$NOISE$FMT}
    BUDGET=(--max_num_patches "${MAX_NUM_PATCHES:-16}") ;;
  *) echo "LOSS=$LOSS: softmax (CLIP), sigmoid (SigLIP) or siglip2 (SigLIP 2, NaFlex)" >&2; exit 2 ;;
esac
# the training source: run_clip's flags for a datasets dataset (its train split, image and caption columns)
if [ "$DATA_FORMAT" = hf ]; then
  TRAIN_DATA=(--dataset_name "$DATA/train" --train_split train --image_column image --caption_column caption)
else
  TRAIN_DATA=(--train_shards "$DATA/train")
fi

VENV=${VENV:-.venv}
[ -x $VENV/bin/python ] || python3 -m venv $VENV
# torch first: a bare `torch` requirement pulls a multi-GB CUDA build on a machine without one.
$VENV/bin/python -c "import torch" 2>/dev/null || $VENV/bin/python -m pip install -q "torch==2.13.0"
$VENV/bin/python -c "import disco_clip_ds, deepspeed" 2>/dev/null || $VENV/bin/python -m pip install -q -e .

[ -f "$BUILT" ] || $VENV/bin/disco-clip data demo --format "$DATA_FORMAT" --caption_noise "$CAPTION_NOISE" --output "$DATA"

# AdamW beta2 0.98 / eps 1e-6: the CLIP paper's ViT settings (Radford et al. 2021, appendix F).
# deepspeed's launcher finds no GPU here and starts NPROC CPU ranks (gloo); train.py picks the CPU by itself.
# The launcher logs errors only (its own lines, "Unable to find hostfile" on one node among them, say nothing to act on).
$VENV/bin/deepspeed --log_level error --num_gpus "$NPROC" --master_port "${MASTER_PORT:-29561}" --module disco_clip_ds.train \
  --deepspeed ds_configs/cpu_zero2.json \
  "${TRAIN_DATA[@]}" \
  --model_config "$MODEL" --tokenizer_name recipes/tokenizer --loss_impl tiled \
  --output_dir "$OUT" --max_steps "$STEPS" --per_device_train_batch_size "$PER_RANK" \
  --learning_rate "${LR:-1e-3}" ${OPTIM:+--optim "$OPTIM"} --weight_decay 0.1 --warmup_steps 30 --lr_scheduler_type cosine --adam_beta2 0.98 --adam_epsilon 1e-6 \
  --logging_steps 20 --save_steps 100 --save_total_limit 2 --dataloader_num_workers 1 --seed "$SEED" \
  --zeroshot_data "$DATA/eval" --zeroshot_steps 100 --patch_dropout "$PATCH_DROPOUT" "${BUDGET[@]+"${BUDGET[@]}"}" \
  ${PATCH_DROPOUT_UNTIL_STEP:+--patch_dropout_until_step "$PATCH_DROPOUT_UNTIL_STEP"} \
  ${RESOLUTION_SCHEDULE:+--resolution_schedule "$RESOLUTION_SCHEDULE"} \
  ${TEACHER:+--teacher "$TEACHER" --distill_weight "${DISTILL_WEIGHT:-0.5}"} \
  ${DISTILL_TEMPERATURE:+--distill_temperature "$DISTILL_TEMPERATURE"} \
  ${EMA_DECAY:+--ema_decay "$EMA_DECAY" --eval_ema true} \
  --resume_from_checkpoint latest

# Evaluate the trained model on the held-out digits (CLIP_benchmark metrics and JSON), then export it as a
# plain CLIPModel (or SiglipModel) folder with a model card; `disco-clip push "$OUT/export" --repo_id USER/NAME` uploads it.
# --data reads either format: shards, or the parquet dataset (its one split, Image, ClassLabel and caption columns).
$VENV/bin/disco-clip eval --model "$OUT" --data "$DATA/eval" --task zeroshot_classification --output "$OUT/eval/zeroshot_classification.json"
$VENV/bin/disco-clip eval --model "$OUT" --data "$DATA/eval" --task zeroshot_retrieval --output "$OUT/eval/zeroshot_retrieval.json"
rm -rf "$OUT/export"  # this script's own previous export: export refuses to write into a non-empty folder
$VENV/bin/disco-clip export "$OUT" "$OUT/export" --eval_results "$OUT/eval/zeroshot_classification.json" "$OUT/eval/zeroshot_retrieval.json"

# Both zero-shot figures side by side: the run's own at its last step (trainer_state.json) and `disco-clip eval`'s of the
# saved model (the tokenizer and processor reloaded as users load them); they agree. Saved in $OUT/eval/zeroshot_both.json.
$VENV/bin/python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
state = out / "trainer_state.json"
history = json.loads(state.read_text())["log_history"] if state.is_file() else []
during = ([e for e in history if "zeroshot_acc1" in e] or [{}])[-1]
final = json.loads((out / "eval" / "zeroshot_classification.json").read_text())["metrics"]
both = {"in_training_step": during.get("step"), "in_training_acc1": during.get("zeroshot_acc1"),
        "disco_clip_eval_acc1": final["acc1"]}
(out / "eval" / "zeroshot_both.json").write_text(json.dumps(both, indent=2) + "\n")
print(f"zero-shot acc1: {both['in_training_acc1']} in training (step {both['in_training_step']}), "
      f"{both['disco_clip_eval_acc1']} by disco-clip eval of {out}")
PY
