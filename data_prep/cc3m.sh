#!/usr/bin/env bash
# Conceptual Captions 3M (CC3M), from Google's training TSV (3.3M rows, no header line).
#   1. download Train_GCC-training.tsv from https://ai.google.com/research/ConceptualCaptions/download
#   2. bash data_prep/cc3m.sh path/to/Train_GCC-training.tsv
#
#   images: ~3.3M requested, ~2.5M still arrive; ~40 GB at 256 px;
#   time:   ~1 h on one 16-core machine at ~1,000 img/s (the URLs are spread over many hosts);
#   machines: CPU only. Re-run the same command after any interruption.
set -euo pipefail
TSV=${1:?usage: $0 Train_GCC-training.tsv}
META=${META:-data/cc3m/metadata}
OUT=${OUT:-data/cc3m/shards}
mkdir -p "$META"
# Google's file has no header; the cc preset reads the columns by name.
{ printf 'caption\turl\n'; cat "$TSV"; } > "$META/cc3m.tsv"
disco-clip data download --preset cc --url_list "$META/cc3m.tsv" --output "$OUT" \
  --processes "${PROCESSES:-16}" --threads "${THREADS:-64}" --samples_per_shard 10000 --image_size 256 \
  --timeout 10 --max_download_seconds 60 --retries 1
disco-clip data verify "$OUT"
