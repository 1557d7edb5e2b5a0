#!/usr/bin/env bash
# Re-LAION-2B-en research-safe (or the parquet parts you choose) on a Spark standalone cluster:
# one master (also the driver) and N workers, with the settings of img2dataset's LAION-5B example
# (dataset_examples/laion5B.md): 16-core c6i.4xlarge workers, one executor per worker running 16 shard
# tasks at once, 64 download threads per task, 10,000 samples per shard, ~1,000 samples/s per worker.
#
#   bash relaion2b_spark.sh pack       # on the master: build and pack the download environment
#   bash relaion2b_spark.sh cluster    # on the master: unpack it on every worker, start master + workers
#   bash relaion2b_spark.sh download   # on the master: metadata, the Spark download, verify
#   bash relaion2b_spark.sh stop       # on the master: stop workers and master
#
# Needs (sources in data_prep/README.md, "Moving to Spark"):
#   machines: 1 master + WORKERS (default 10) c6i.4xlarge, same OS image (venv-pack links the base
#             Python, so /usr/bin/python3.X must be the same on all nodes), Java 17+ on each, ssh
#             from the master to the workers (parallel-ssh), a DNS resolver that takes the load.
#   storage:  OUT must be one POSIX folder mounted at the same path on the master and all workers
#             (NFS, EFS, Lustre, or sshfs as in img2dataset's distributed tutorial): executors write
#             the tars there and the driver reads them for sizes.json/summary.json.
#   disk:     ~8.5 KB per metadata row at 256 px (img2dataset's laion5B.md: 50 TB for 5.86B rows),
#             so ~18 TB for all ~2.1B rows; metadata a few GB per 100M rows.
#   time:     ~10 workers x 1,000 samples/s = 10,000/s: ~2.5 days for 2.1B rows, ~11 h for 400M.
# Re-run `download` after any interruption: finished shards are kept, the rest is redone.
set -euo pipefail
set -f  # the --pattern globs are for the hub, not for this shell

STEP=${1:-download}
ENV_DIR=${ENV_DIR:-/opt/disco-clip-env}          # same path on every node
ARCHIVE=${ARCHIVE:-disco-clip-env.tar.gz}
WORKERS_FILE=${WORKERS_FILE:-workers.txt}         # one worker host per line
MASTER_HOST=${MASTER_HOST:-$(hostname -I 2>/dev/null | cut -d' ' -f1)}
MASTER=${MASTER:-spark://$MASTER_HOST:7077}
META=${META:-data/relaion2b/metadata}
OUT=${OUT:-/mnt/shared/relaion2b/shards}
PARTS=${PARTS:-"*.parquet"}                       # e.g. "part-0000[0-9]-*" for a part of it
THREADS=${THREADS:-64}
PYTHON=${PYTHON:-python3}
REPO=${REPO:-$(cd "$(dirname "$0")/.." && pwd)}

case "$STEP" in
pack)
  # Only what a downloader needs: img2dataset, pyspark (the driver's and workers' Spark, same version)
  # and this package without its training dependencies (torch, deepspeed): prep imports none of them.
  "$PYTHON" -m venv "$ENV_DIR"
  "$ENV_DIR/bin/pip" install "img2dataset>=1.45,<1.48" "pyspark>=4.0,<4.4" "huggingface_hub>=1.0,<3" venv-pack
  "$ENV_DIR/bin/pip" install --no-deps "$REPO"
  "$ENV_DIR/bin/venv-pack" -p "$ENV_DIR" -o "$ARCHIVE" --force
  ;;
cluster)
  # The packed venv is both the workers' Spark (bin/spark-class) and the executors' Python.
  parallel-scp -h "$WORKERS_FILE" "$ARCHIVE" /tmp/
  parallel-ssh -i -h "$WORKERS_FILE" "sudo mkdir -p $ENV_DIR && sudo chown \$USER $ENV_DIR && tar -xzf /tmp/$ARCHIVE -C $ENV_DIR"
  # spark-class finds Spark (SPARK_HOME) through the Python that has pyspark
  PYSPARK_PYTHON="$ENV_DIR/bin/python" nohup "$ENV_DIR/bin/spark-class" org.apache.spark.deploy.master.Master --host "$MASTER_HOST" --port 7077 \
    --webui-port 8080 > spark-master.log 2>&1 &
  # 16 cores, 24 GB per worker: laion5B.md's `start-worker.sh -c 16 -m 24G`
  parallel-ssh -i -h "$WORKERS_FILE" "PYSPARK_PYTHON=$ENV_DIR/bin/python nohup $ENV_DIR/bin/spark-class \
    org.apache.spark.deploy.worker.Worker \
    --cores 16 --memory 24G $MASTER > spark-worker.log 2>&1 &"
  echo "master $MASTER; web UI http://$MASTER_HOST:8080"
  ;;
download)
  "$ENV_DIR/bin/disco-clip" data metadata --dataset laion/relaion2B-en-research-safe --output "$META" --pattern $PARTS
  # Executor settings from laion5B.md: 16G + 8G overhead per 16-core executor, tasks retried up to
  # 100 times (a lost worker's shards go elsewhere). --processes is ignored on a cluster: Spark
  # runs one task per shard on every executor core.
  "$ENV_DIR/bin/spark-submit" --master "$MASTER" --deploy-mode client \
    --conf spark.pyspark.python="$ENV_DIR/bin/python" \
    --conf spark.pyspark.driver.python="$ENV_DIR/bin/python" \
    --conf spark.executor.memory=16G --conf spark.executor.memoryOverhead=8G \
    --conf spark.task.maxFailures=100 \
    "$("$ENV_DIR/bin/python" -c 'import disco_clip_ds.cli as m; print(m.__file__)')" data download \
    --preset relaion --url_list "$META" --output "$OUT" --distributor pyspark \
    --processes 1 --threads "$THREADS" --samples_per_shard 10000 --image_size 256 --resize_mode border \
    --timeout 10 --max_download_seconds 60 --retries 0
  "$ENV_DIR/bin/disco-clip" data verify "$OUT"
  ;;
stop)
  parallel-ssh -i -h "$WORKERS_FILE" "pkill -f org.apache.spark.deploy.worker.Worker || true"
  pkill -f org.apache.spark.deploy.master.Master || true
  ;;
*)
  echo "usage: $0 pack|cluster|download|stop" >&2
  exit 2
  ;;
esac
