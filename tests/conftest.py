"""Fixtures: the loopback image server and the demo dataset; environment for every test. The harness is
disco_clip_ds.testing; a slow test is marked `slow` in its own file."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

from disco_clip_ds.testing.imageserver import ImageServer
from disco_clip_ds.testing.ranks import release_shm_buffers

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# teacher fingerprints are cached in a folder of the test session's own (data/teacher_id.py), never the user's
if "DISCO_CLIP_CACHE" not in os.environ:
    os.environ["DISCO_CLIP_CACHE"] = tempfile.mkdtemp(prefix="disco-clip-cache-")
    atexit.register(shutil.rmtree, os.environ["DISCO_CLIP_CACHE"], True)


@pytest.fixture(autouse=True)
def _release_deepspeed_shm_buffers():
    """A safety net: training unlinks DeepSpeed's 66 MiB per-rank /dev/shm buffers once every rank has mapped them
    (compat.unlink_deepspeed_shm_buffer), but a run killed during DeepSpeed's start-up leaves its own; over the
    suite's launches those would add up. Unlink any left by the runs this test started, once it ends."""
    yield
    release_shm_buffers()


@pytest.fixture
def image_server():
    """A running `ImageServer` on 127.0.0.1 (add routes with `.add(path, ...)`)."""
    with ImageServer() as server:
        yield server


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory):
    """The digits demo dataset (`disco-clip data demo`), built once per test session; returns its folder. A test
    that uses it is slow (the build is an img2dataset download)."""
    from disco_clip_ds.data.prep.demo import build_demo

    folder = tmp_path_factory.mktemp("demo")
    build_demo(folder)
    return folder
