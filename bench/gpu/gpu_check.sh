#!/usr/bin/env bash
# The GPU check: one prepared run on one H200 in at most 10 minutes (part limits: 15 + 40 + 2 x 75 + 150 + 120 + 90
# s, plus 5 s grace each = 595 s). Every part writes its CSV (and log) under
# $OUT (default bench/gpu/results/gpu) and runs under its own time limit, so a part that fails or overruns leaves the
# others' results and the total stays under 10 minutes; $OUT/parts.csv says how each part ended.
#   env        nvidia-smi and library versions                                        (env.txt)
#   infcl      pip install of Inf-CL's PyPI package `inf-cl` into a scratch folder; the machine may have no
#              internet (or pass INF_CL_WHEELS=folder-with-the-wheel): then Inf-CL is left out of the loss parts
#   loss_bf16  bench/loss/loss_bench.py --device cuda --world 1: disco, [infcl,] tiled from B = 32K doubling while a
#   loss_fp32  configuration fits the GPU and its time limit (an OOM or timeout at one B skips the larger ones)
#   step       bench/gpu/gpu_step.py: ViT-B/32 bf16 DeepSpeed ZeRO-2 steps at 1024 and 4096 per GPU (activation
#              checkpointing, tiled loss): samples/s and peak memory against `disco-clip plan`'s estimate
#   compile    bench/train/compile_step.py: ViT-B/32 bf16 ZeRO-2 step time with the towers compiled (inductor,
#              --torch_compile) against eager, interleaved rounds at 256 per GPU, and the first compiled step
#   train      `disco-clip train` (the Trainer, one rank under torchrun): ViT-B/32 bf16 ZeRO-2 at 256 per GPU on
#              generated shards; bench/gpu/train_figures.py prints what its logs hold: samples/s, TFLOPs per device
#              and MFU per logging step (trainer_state.json) and for the run (train_results.json)   (train.csv)
#
#   bash bench/gpu/gpu_check.sh             # on the GPU machine (PYTHON=... to pick the interpreter)
#   bash bench/gpu/gpu_check.sh --cpu-smoke # tiny sizes on CPU: every part and code path above, no GPU needed
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/gpu/results/gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
# The GPU machine's interpreter need not have this checkout installed: PYTHONPATH makes disco_clip_ds importable.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 NO_ALBUMENTATIONS_UPDATE=1 TOKENIZERS_PARALLELISM=false
export no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}"

if [ "${1:-}" = "--cpu-smoke" ]; then
  DEVICE=cpu LOSS_BATCH="256 512" LOSS_LIMIT=400 LOSS_CONFIG_LIMIT=200 LOSS_CHUNK=${LOSS_CHUNK-96}
  STEP_ARGS=(--model recipes/models/tiny.json --per_device 32 64 --precision fp32 --steps 2 --timeout 300)
  STEP_LIMIT=700
  COMPILE_ARGS=(--models tiny --per_device 32 --precision fp32 --rounds 2)
  COMPILE_LIMIT=400
  TRAIN_ARGS=(--model_config recipes/models/tiny.json --per_device_train_batch_size 32 --max_steps 6 --logging_steps 2)
  TRAIN_LIMIT=300
else
  DEVICE=cuda LOSS_BATCH="32768 65536 131072 262144 524288" LOSS_LIMIT=75 LOSS_CONFIG_LIMIT=50
  # The loss's default tile (2M logits) was sized on CPU; at B = 32K it is 64 rows, 512 tiles of a dozen small
  # kernels per pass on one GPU. 1024-row tiles (128 MiB at 32K, 2 GiB at 512K) keep the H200 busy instead.
  # LOSS_CHUNK= (empty) measures the default.
  LOSS_CHUNK=${LOSS_CHUNK-1024}
  # 4096 per GPU keeps 148 GiB of bf16 activations without checkpointing (the planner's fit): on for both points.
  STEP_ARGS=(--model recipes/models/vit_b32.json --per_device 1024 4096 --precision bf16 --steps 3 --timeout 70
             --activation_checkpointing --gpu_memory 139GB)
  STEP_LIMIT=150
  # inductor's compile of both towers (forward and backward) is most of this part's time
  COMPILE_ARGS=(--models vit_b32 --per_device 256 --precision bf16 --rounds 5)
  COMPILE_LIMIT=120
  TRAIN_ARGS=(--model_config recipes/models/vit_b32.json --per_device_train_batch_size 256 --max_steps 30
              --logging_steps 10 --bf16 --dataloader_num_workers 8)
  TRAIN_LIMIT=90
fi

echo "part,exit_code,seconds,result" > "$OUT/parts.csv"
part() {  # part NAME LIMIT_S CMD...: run CMD under LIMIT_S (then SIGKILL 5 s later), log and record it
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  echo "== $name (limit ${limit} s): $*"
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  local result=ok
  [ $rc -ne 0 ] && result=failed
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && result="timed out"
  echo "$name,$rc,$(($(date +%s) - start)),$result" | tee -a "$OUT/parts.csv"
  tail -n 3 "$OUT/$name.log"
}

part env 15 bash -c "nvidia-smi || echo 'no nvidia-smi'; $PY -c 'import torch, transformers, deepspeed
print(\"torch\", torch.__version__, \"cuda\", torch.cuda.is_available(), \"transformers\", transformers.__version__, \"deepspeed\", deepspeed.__version__)'"
cp "$OUT/env.log" "$OUT/env.txt"

# --no-deps: inf-cl asks for torch and triton, and pip must not replace the machine's CUDA torch. Installed into a
# scratch folder, so that the environment is left as it was.
DEPS=$(mktemp -d)
trap 'rm -rf "$DEPS"' EXIT
WHEELS=()
[ -n "${INF_CL_WHEELS:-}" ] && WHEELS=(--no-index --find-links "$INF_CL_WHEELS")
part infcl 40 bash -c "$PY -m pip install --no-deps --disable-pip-version-check --retries 0 --timeout 10 --target '$DEPS' ${WHEELS[*]:-} inf-cl \
  && PYTHONPATH='$DEPS' $PY -c 'import inf_cl; print(\"inf_cl importable\")'"
IMPLS="disco tiled"
if grep -q "inf_cl importable" "$OUT/infcl.log"; then
  IMPLS="disco infcl tiled"
  export PYTHONPATH="$PYTHONPATH:$DEPS"
else
  echo "inf-cl not installable or not importable here: the loss parts run without it (see $OUT/infcl.log)"
fi

for dtype in bf16 fp32; do
  # shellcheck disable=SC2086  # word splitting of the lists is meant
  part "loss_$dtype" "$LOSS_LIMIT" "$PY" bench/loss/loss_bench.py --device "$DEVICE" --world 1 --batch $LOSS_BATCH \
    --dtype "$dtype" --impl $IMPLS --reps 1 --timeout "$LOSS_CONFIG_LIMIT" ${LOSS_CHUNK:+--chunk_size "$LOSS_CHUNK"} \
    --out "$OUT/loss_$dtype.csv"
done

part step "$STEP_LIMIT" "$PY" bench/gpu/gpu_step.py --device "$DEVICE" "${STEP_ARGS[@]}" --out "$OUT/step.csv"

part compile "$COMPILE_LIMIT" "$PY" bench/train/compile_step.py --device "$DEVICE" "${COMPILE_ARGS[@]}" \
  --out "$OUT/compile.csv"

# generated shards (the demo's digit captions; images 40-90 px a side, resized as training resizes any image)
part train "$TRAIN_LIMIT" bash -c "rm -rf '$OUT/train' '$OUT/train_data' \
  && $PY -c 'import sys; from pathlib import Path; from disco_clip_ds.testing.images import write_shards
write_shards(Path(sys.argv[1]), num_shards=4, per_shard=2048)' '$OUT/train_data' \
  && $PY -m torch.distributed.run --nproc_per_node 1 -m disco_clip_ds.train --output_dir '$OUT/train' \
     --train_shards '$OUT/train_data/{00000..00003}.tar' --tokenizer_name recipes/tokenizer \
     --deepspeed ds_configs/cpu_zero2.json --report_to none --save_strategy no ${TRAIN_ARGS[*]} \
  && $PY bench/gpu/train_figures.py '$OUT/train' --out '$OUT/train.csv'"

for f in "$OUT"/parts.csv "$OUT"/loss_*.csv "$OUT"/step.csv "$OUT"/compile.csv "$OUT"/train.csv; do
  [ -f "$f" ] && { echo "== $f"; cat "$f"; }
done
exit 0
