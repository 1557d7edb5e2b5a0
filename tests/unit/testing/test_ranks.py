"""testing/ranks.run_ranks: ranks forked from multiprocessing's fork server (the imports done once) see the caller's
environment as it is at the call; a call that gives `env` spawns its ranks, which start with it; a change in a variable
read at import since the server started restarts the server in it."""

import os

import pytest

from disco_clip_ds.data.prep.fetch import environ
from disco_clip_ds.testing.ranks import run_ranks

pytestmark = pytest.mark.slow  # starts processes


def _seen(rank, world_size, names):
    """(this rank's parent pid, the values of NAMES here)."""
    return os.getppid(), {name: os.environ.get(name) for name in names}


def _one_rank(names):
    return run_ranks(_seen, 1, names, timeout=120)[0]


def test_a_forked_rank_sees_the_callers_environment_at_the_call():
    _one_rank([])  # the fork server started
    with environ(DISCO_TEST_AT_CALL="1"):
        parent, seen = _one_rank(["DISCO_TEST_AT_CALL"])
    assert parent != os.getpid()  # forked by the server, not spawned by this process
    assert seen == {"DISCO_TEST_AT_CALL": "1"}


def test_env_spawns_the_ranks_and_a_changed_import_time_variable_restarts_the_server():
    server, _ = _one_rank([])
    parent, seen = run_ranks(_seen, 1, ["MALLOC_ARENA_MAX"], env={"MALLOC_ARENA_MAX": "2"}, timeout=120)[0]
    assert parent == os.getpid() and seen == {"MALLOC_ARENA_MAX": "2"}
    assert _one_rank([])[0] == server  # `env` left the server as it was
    with environ(OMP_DISCO_TEST="1"):  # read at import by OpenMP-style libraries: the server's imports predate it
        restarted, seen = _one_rank(["OMP_DISCO_TEST"])
    assert restarted not in (server, os.getpid()) and seen == {"OMP_DISCO_TEST": "1"}
    back, seen = _one_rank(["OMP_DISCO_TEST"])
    assert back not in (restarted, os.getpid()) and seen == {"OMP_DISCO_TEST": None}
