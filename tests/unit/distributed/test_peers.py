"""distributed/peers.py: the collective timeout's default, a master nobody answers and a peer lost in training as one
line (PeerError), other errors passed through. Launched, across two nodes: tests/launched/test_lost_peer.py."""

import time

import pytest
import torch

from disco_clip_ds.testing.ranks import free_port


def test_the_default_ends_a_lost_peer_within_minutes(tmp_path):
    from disco_clip_ds.train.args import DiscoTrainingArguments

    assert DiscoTrainingArguments(output_dir=str(tmp_path)).ddp_timeout == 600


@pytest.mark.slow  # waits out its connect timeout (2 s)
def test_a_closed_master_port_is_one_line_naming_it(monkeypatch):
    from disco_clip_ds.distributed.peers import joining
    from disco_clip_ds.errors import PeerError

    port = free_port()  # bound by nobody
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    with pytest.raises(PeerError, match=f"no master answered at 127.0.0.1:{port} within --ddp_timeout 2 s"):
        with joining(2):
            pytest.fail("joined a master that does not exist")
    assert 2 <= time.monotonic() - started < 10


@pytest.mark.parametrize(
    "raised, expected",
    [
        (
            RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation "
                         "to complete"),
            "got no answer within --ddp_timeout 20 s, or its peer closed the connection: Timed out waiting 20000ms "
            "for recv operation to complete); look at the other nodes' logs",
        ),
        (
            torch.distributed.DistBackendError("Read error [127.0.0.1]:37511: Connection reset by peer. This is "
                                               "typically caused by a remote worker hanging"),
            "closed the connection: Read error [127.0.0.1]:37511: Connection reset by peer); look",
        ),
    ],
)  # fmt: skip
def test_a_lost_peer_in_training_is_one_line(raised, expected):
    from disco_clip_ds.distributed.peers import watching
    from disco_clip_ds.errors import PeerError

    with pytest.raises(PeerError, match="lost contact with another rank") as error:
        with watching(20):
            raise raised
    assert expected in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("raised", [RuntimeError("CUDA out of memory"), ValueError("timeout")])
def test_other_errors_in_training_pass_through(raised):
    from disco_clip_ds.distributed.peers import watching

    with pytest.raises(type(raised)) as error:
        with watching(20):
            raise raised
    assert error.value is raised
