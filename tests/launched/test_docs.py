"""Every shell block of the user docs (README.md, docs/*.md) runs as written, on the demo data with the tiny models.

One test per page. A page's blocks run in order in a scratch copy of the checkout (a guide is a sequence: a block
sees what the blocks before it wrote), which already holds the demo (data/demo) and the quickstart's model
(outputs/quickstart), built once per session. A block marked `<!-- docs-test: skip (REASON) -->` (a GPU, a cluster,
the network, a peer venv, a fragment with `...`) is not run; the page's test lists those with their reasons.

What shrinks a block without changing what it says: STEPS (recipes/quickstart.sh's step count) and
DISCO_CLIP_MAX_STEPS (a cap on any training run's --max_steps, train/args.py) are set to a few steps. Each block's
time is printed (`-s`): the expensive ones are the launches (each pays the launcher's and DeepSpeed's start-up) and
the demo builds (an img2dataset download from a loopback server).
"""

import os
import re
import shutil
import time

import pytest

from disco_clip_ds.testing.docblocks import Block, block_env, blocks, copy_checkout, pages, run_block
from disco_clip_ds.testing.launch import REPO

# The docs test takes about a quarter of an hour on 2 cores (each page's launches and demo builds, as written): more
# than the suite's budget allows, so it runs when asked, `DISCO_DOCS_TEST=1 bash tests/run.sh
# tests/launched/test_docs.py`, as .ci/run does after the suite (docs/development.md, "The docs test"); its skip says
# so in every other run.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(3600),  # a page runs several launches in sequence
    pytest.mark.skipif(
        os.environ.get("DISCO_DOCS_TEST") != "1",
        reason="the docs test runs when asked: DISCO_DOCS_TEST=1 bash tests/run.sh tests/launched/test_docs.py",
    ),
]

STEPS = "3"
SHRINK = {"STEPS": STEPS, "DISCO_CLIP_MAX_STEPS": STEPS}
BLOCK_TIMEOUT = 1200  # a block of two launches takes minutes on a busy 2-core machine
PAGES = [p for p in pages(REPO) if blocks(p)]


@pytest.fixture(scope="session")
def docs_checkout(tmp_path_factory, demo_data):
    """A scratch checkout with the demo in data/demo and the quickstart's model in outputs/quickstart (trained for
    STEPS steps): what a reader of the docs has once the README's quickstart ran."""
    checkout = copy_checkout(REPO, tmp_path_factory.mktemp("docs") / "repo")
    shutil.copytree(demo_data, checkout / "data" / "demo")
    log = checkout.parent / "quickstart.log"
    code = run_block(
        Block("fixture", 0, "bash recipes/quickstart.sh"), checkout, block_env(checkout, **SHRINK), log, BLOCK_TIMEOUT
    )
    assert code == 0, "the quickstart failed:\n" + log.read_text()[-4000:]
    return checkout


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_shell_block_of_the_page_runs(page, docs_checkout, tmp_path):
    """The page's unmarked blocks, in order, each exit 0; the first that does not fails the test with its page and
    line, its commands and the tail of its output."""
    work = tmp_path / "repo"
    shutil.copytree(docs_checkout, work, symlinks=True)
    env, log = block_env(work, **SHRINK), tmp_path / "blocks.log"
    skipped, ran = [], 0
    for block in blocks(page, page.relative_to(REPO).as_posix()):
        if block.skip:
            skipped.append(f"{block.page}:{block.line} ({block.skip})")
            continue
        ran += 1
        start, before = time.monotonic(), log.stat().st_size if log.exists() else 0
        code = run_block(block, work, env, log, BLOCK_TIMEOUT)
        print(f"{block.page}:{block.line}: exit {code} in {time.monotonic() - start:.0f} s")
        if code != 0:
            tail = log.read_text(errors="replace")[before:][-3000:]
            pytest.fail(f"{block.page}:{block.line} exited {code}:\n{block.commands}\n--- output (tail) ---\n{tail}")
    if skipped:
        print("skipped: " + "; ".join(skipped))
    if not ran:
        pytest.skip("every block is marked: " + "; ".join(skipped))


def test_the_quickstart_says_each_start_up_phase_and_no_warning_twice(docs_checkout):
    """The quickstart's own output (the fixture's launch: deepspeed, 2 CPU ranks, eval, export): rank 0 says each
    start-up phase once, with its seconds; the warnings nobody can act on on a CPU machine are gone (DeepSpeed's
    accelerator and hostfile ones, transformers' torchvision fallback), and no warning line is said twice."""
    from disco_clip_ds.distributed.startup import PHASES

    log = (docs_checkout.parent / "quickstart.log").read_text(errors="replace")
    for phase in PHASES.values():
        assert log.count(f"): {phase}") == 1, (phase, log[-3000:])
    assert log.index(PHASES[0]) < log.index(PHASES[max(PHASES)])
    for noise in ("Setting accelerator to CPU", "Unable to find hostfile", "requires torchvision"):
        assert noise not in log, noise
    assert log.count("MFU is not logged") <= 1
    warnings = [re.sub(r"^\[?[\d-]+ [\d:,]+\]? ?", "", line) for line in log.splitlines() if "WARN" in line.upper()]
    twice = {line for line in warnings if warnings.count(line) > 1}
    assert not twice, twice
