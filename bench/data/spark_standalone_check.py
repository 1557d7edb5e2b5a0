"""`--spark_master spark://...` against a real Spark standalone cluster: one master and one worker on 127.0.0.1.

Too heavy for the test suite (master, worker, executor and driver JVMs); run by hand:

    .venv/bin/python bench/data/spark_standalone_check.py

Starts the master and worker from this venv's pyspark (disco_clip_ds.testing.spark, as
data_prep/relaion2b_spark.sh does on a cluster), downloads the same loopback input with the multiprocessing path and
with `--distributor pyspark --spark_master spark://127.0.0.1:PORT` (executors in their own JVM, Python workers
from PYSPARK_PYTHON), and checks that shards, sizes.json and summary.json are byte-identical and that a
trickling image was cut by the deadline inside the executor. Stops both daemons at the end.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from disco_clip_ds.testing.download import download_args, write_url_list
from disco_clip_ds.testing.images import image_bytes
from disco_clip_ds.testing.imageserver import ImageServer
from disco_clip_ds.testing.spark import cluster_env, executor_folders, standalone_cluster


def _image(i: int) -> bytes:
    return image_bytes("JPEG", "RGB", (40 + i, 30), (10 * i % 256, 80, 200))


def main() -> int:
    from disco_clip_ds.commands.data import download_main

    tmp = Path(tempfile.mkdtemp(prefix="spark_standalone_"))
    # the driver joins the daemons' environment: loopback only, executors' Python workers on this interpreter
    os.environ.update({k: v for k, v in cluster_env(tmp / "work").items() if k in ("PYSPARK_PYTHON", "SPARK_LOCAL_IP")})
    with standalone_cluster(tmp, workers=1, cores=2, memory="2G") as master_url:
        with ImageServer() as server:
            rows = [(server.add(f"/{i}.jpg", body=_image(i)), f"image {i}") for i in range(10)]
            rows.append((server.add("/trickle.jpg", body=_image(99) * 40, trickle=0.2), "trickles"))
            rows.append((server.add("/gone.jpg", status=404), "gone"))
            url_list = write_url_list(tmp / "urls.parquet", rows)
            options = dict(image_size=32, threads=4, samples_per_shard=4, timeout=2, max_download_seconds=3)
            assert download_main(download_args(url_list, tmp / "mp", **options, processes=2)) == 0
            started = time.monotonic()
            rc = download_main(
                download_args(url_list, tmp / "cluster", **options, distributor="pyspark", spark_master=master_url)
            )
            seconds = time.monotonic() - started
    assert rc == 0, rc
    names = sorted(p.name for p in (tmp / "mp").glob("*.tar")) + ["sizes.json", "summary.json"]
    same = all((tmp / "mp" / n).read_bytes() == (tmp / "cluster" / n).read_bytes() for n in names)
    reasons = json.loads((tmp / "cluster" / "summary.json").read_text())["failures_by_reason"]
    print(f"standalone {master_url}: {seconds:.1f}s, byte-identical to multiprocessing: {same}; failures {reasons}")
    assert same and reasons.get("download exceeded the 3s deadline") == 1, reasons
    executors = executor_folders(tmp)
    assert executors, "no executor ran on the worker"
    print(f"executor logs: {len(executors)} under {tmp / 'work'}; OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
