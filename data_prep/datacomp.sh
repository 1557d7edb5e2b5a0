#!/usr/bin/env bash
# DataComp small (12.8M) or medium (128M) pool, as DataComp's own download_upstream.py does it:
# 512 px keep_ratio_largest, uid kept, sha256 of each image recorded.
#   bash data_prep/datacomp.sh small|medium
#
#   metadata: ~1 GB (small), ~10 GB (medium), public on the HF hub, no login needed;
#   images:   ~40 KB per 512 px JPEG: ~0.5 TB (small), ~5 TB (medium) if everything still downloaded
#             (pass --image_size 256 for about a third of that);
#   time:     at ~1,000-1,500 img/s per 16-core machine: ~3 h (small), ~1-1.5 days (medium) on one machine;
#   machines: CPU only. Re-run the same command after any interruption.
set -euo pipefail
SCALE=${1:-small}
case "$SCALE" in small|medium) ;; *) echo "usage: $0 small|medium" >&2; exit 2 ;; esac
META=${META:-data/datacomp_$SCALE/metadata}
OUT=${OUT:-data/datacomp_$SCALE/shards}
PROCESSES=${PROCESSES:-16}
THREADS=${THREADS:-64}

disco-clip data metadata --dataset "mlfoundations/datacomp_$SCALE" --output "$META" --pattern "*.parquet"
disco-clip data download --preset datacomp --url_list "$META" --output "$OUT" \
  --processes "$PROCESSES" --threads "$THREADS" --samples_per_shard 10000 \
  --timeout 10 --max_download_seconds 60 --retries 2
disco-clip data verify "$OUT"

# With TEACHER set, go on as DataComp's CLIP-score baseline does (docs/data.md, "Curation"): embed every shard once
# with the teacher (the sidecars serve distillation too), then keep the best KEEP_FRACTION by CLIP score.
#   TEACHER=openai/clip-vit-large-patch14 bash data_prep/datacomp.sh small     (DataComp's scoring model; one GPU)
if [ -n "${TEACHER:-}" ]; then
  FILTERED=${FILTERED:-data/datacomp_$SCALE/clip_score}
  disco-clip data embed --teacher "$TEACHER" --shards "$OUT"
  disco-clip data filter --shards "$OUT" --teacher "$TEACHER" --keep_fraction "${KEEP_FRACTION:-0.3}" \
    --output "$FILTERED" --samples_per_shard 10000 --processes "$PROCESSES"
fi
