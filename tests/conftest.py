"""Fixtures: the loopback image server and the demo dataset; environment for every test (helpers live in helpers.py)."""

from __future__ import annotations

import os

import pytest

from helpers import release_shm_buffers

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _release_deepspeed_shm_buffers():
    """DeepSpeed's CPU comm op leaves a 66 MiB /dev/shm buffer per rank behind after every multi-rank run; over the
    suite's launches that is gigabytes of RAM. Unlink those of the runs this test started, once it ends."""
    yield
    release_shm_buffers()


# --- data: the loopback image server and the demo dataset (owned by the data-prep tests) ---


@pytest.fixture
def image_server():
    """A running `imageserver.ImageServer` on 127.0.0.1 (add routes with `.add(path, ...)`)."""
    from imageserver import ImageServer

    with ImageServer() as server:
        yield server


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory):
    """The digits demo dataset (`disco-clip data demo`), built once per test session; returns its folder."""
    from disco_clip_ds.data.demo import build_demo

    folder = tmp_path_factory.mktemp("demo")
    build_demo(folder)
    return folder


# Fixtures that launch training, a Spark job or an img2dataset download: a test using one is in the slow tier.
SLOW_FIXTURES = {"runs", "trained_checkpoints", "zero3_run", "adversarial", "references", "demo_data"}


def pytest_collection_modifyitems(items):
    for item in items:
        if SLOW_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
