"""What the tests and the benchmarks share (as transformers.testing_utils does): no test logic, only harness.

    ranks        free ports, `run_ranks` (N spawned torch.distributed ranks), DeepSpeed's shm buffers
    memory       peak memory of a piece of work (resident memory on CPU, the allocator's count on CUDA)
    wire         `WireBytes`: the bytes a rank sends through torch.distributed's collectives
    images       image bytes, training shards and eval shards made on the spot
    imageserver  `ImageServer`: a loopback HTTP server with good, failing, hanging and trickling routes
    download     the URL list and the arguments of `disco-clip data download`
    launch       `disco_clip_ds.train` on CPU ranks: paths, the launcher command, its environment and arguments

Everything is importable from here; each module imports torch and friends only inside its functions.
"""

from .download import download_args, write_url_list
from .images import image_bytes, noise_image_bytes, write_samples, write_shards
from .imageserver import ImageServer
from .launch import (
    LAUNCH_COMMON,
    LAUNCH_SEED,
    REPO,
    SGD,
    TINY_CONFIG,
    TOKENIZER_DIR,
    launch,
    launch_in_one_process,
    run_training,
    train_command,
    train_env,
)
from .memory import mmap_threshold_env, peak_extra_mib, reset_peak_rss, rss_mib
from .ranks import RanksFailed, free_port, release_shm_buffers, run_ranks
from .wire import WireBytes

__all__ = [
    "LAUNCH_COMMON",
    "LAUNCH_SEED",
    "REPO",
    "SGD",
    "TINY_CONFIG",
    "TOKENIZER_DIR",
    "ImageServer",
    "RanksFailed",
    "WireBytes",
    "download_args",
    "free_port",
    "image_bytes",
    "launch",
    "launch_in_one_process",
    "mmap_threshold_env",
    "noise_image_bytes",
    "peak_extra_mib",
    "release_shm_buffers",
    "reset_peak_rss",
    "rss_mib",
    "run_ranks",
    "run_training",
    "train_command",
    "train_env",
    "write_samples",
    "write_shards",
    "write_url_list",
]
