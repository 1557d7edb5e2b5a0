#!/usr/bin/env bash
# Re-LAION, 400M-scale: the English research-safe Re-LAION metadata, ~2.1B rows in total, of which this
# takes the first parquet parts up to roughly 400M rows (set PARTS), downloaded at 256 px (border).
#
# Needs: a Hugging Face account that accepted the dataset's terms (it is gated) and `hf auth login`.
#   metadata: a few GB per 100M rows;  images: ~10 TB at 256 px for 400M samples requested
#             (expect 60-80 % to still download: the rest is link rot);
#   time:     img2dataset does ~1,000-1,500 img/s on one 16-core machine with a 1 Gbit/s link, so
#             ~4 days on one machine, or ~10 h on 10 machines with --distributor pyspark.
#   machines: CPU only; a DNS resolver that takes the load (see img2dataset's docs on knot-resolver).
# Re-run the same command after any interruption: finished shards are kept, the rest is redone.
set -euo pipefail
set -f  # the --pattern globs are for the hub, not for this shell
META=${META:-data/relaion/metadata}
OUT=${OUT:-data/relaion/shards}
PARTS=${PARTS:-"part-0000[0-9]-* part-0001[0-9]-* part-0002[0-4]-*"}   # adjust to the row count you want
PROCESSES=${PROCESSES:-16}
THREADS=${THREADS:-64}

disco-clip data metadata --dataset laion/relaion2B-en-research-safe --output "$META" --pattern $PARTS
disco-clip data download --preset relaion --url_list "$META" --output "$OUT" \
  --processes "$PROCESSES" --threads "$THREADS" --samples_per_shard 10000 --image_size 256 --resize_mode border \
  --timeout 10 --max_download_seconds 60 --retries 0
disco-clip data verify "$OUT"
