"""data/redact.py: what may be shown of a data source (run.json, the model card, log lines) and the secret patterns
`disco-clip push` refuses; the `pipe:` reader (data/streams/tar_samples.py) saying nothing of its command. (An
export whose run.json names such a source, and `push` of a folder holding one: unit/export/test_card.py,
unit/export/test_hub.py.)"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from disco_clip_ds.data.redact import describe_data, describe_shards, find_secret, redact_text
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.testing.images import noise_image_bytes, write_samples

HF_TOKEN = "hf_" + "aBcD3fGh1jKlMn0pQrStUvWxYz0123456"  # the shape of a real one, split so no scanner flags the file
AWS_KEY = "AKIA" + "IOSFODNN7EXAMPLE"  # AWS's documented example key id


@pytest.mark.parametrize(
    "spec, shown",
    [
        (
            f"pipe:curl -s -L -H 'Authorization: Bearer {HF_TOKEN}' "
            "https://huggingface.co/datasets/org/set/resolve/main/{00000..00007}.tar",
            "pipe: https://huggingface.co/datasets/org/set/resolve/main/{00000..00007}.tar",
        ),
        (
            "https://user:s3cret-pw@data.example.com:8443/shards/{0..3}.tar?token=abc123&x=1",
            "https://data.example.com:8443/shards/{0..3}.tar?token=***&x=***",
        ),
        (
            f"pipe:AWS_ACCESS_KEY_ID={AWS_KEY} aws s3 cp s3://bucket/laion/{{00000..00099}}.tar -",
            "pipe: s3://bucket/laion/{00000..00099}.tar",
        ),
        ("/home/user/data/train", "data/train"),  # a split's folder shown with its data's name
        ("/home/user/data/train/{00000..00007}.tar", "data/train/{00000..00007}.tar"),
        ("data/demo/train", "demo/train"),
        ("/home/user/train", "train"),  # not with a user's name
        ("/home/user/demo_kept", "demo_kept"),
        ("pipe:cat /home/user/secret-project/{0..3}.tar", "pipe: secret-project/{0..3}.tar"),
        ("pipe:cat /srv/shards/a.tar::/data/b/{0..1}.tar", "pipe: shards/a.tar::b/{0..1}.tar"),
        ("pipe:my-reader --flag", "pipe: ***"),
        ("file:///home/user/data/x.tar", "data/x.tar"),
    ],
)
def test_a_source_is_shown_without_secrets_commands_or_its_folder(spec, shown):
    assert describe_shards(spec) == shown
    assert describe_shards(shown) == shown  # a recorded description shows as itself
    assert describe_data(spec) == shown  # run.json of an older version, which recorded the spec verbatim


def test_a_datasets_description_keeps_its_words_and_loses_secrets_and_folders():
    described = f"datasets file /home/user/private/pairs.parquet, columns image/caption (token {HF_TOKEN})"
    assert describe_data(described) == "datasets file pairs.parquet, columns image/caption (token ***)"


@pytest.mark.parametrize(
    "text, kind",
    [
        (f"HF_TOKEN={HF_TOKEN}", "a Hugging Face token"),
        ("-H 'Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.abc'", "an HTTP bearer token"),
        (f"key id {AWS_KEY}", "an AWS access key id"),
        ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "an AWS secret access key"),
        ("https://me:hunter22@host/x.tar", "a password in a URL"),
        ("https://host/x.tar?X-Amz-Signature=0123abcd", "a token in a URL query"),
    ],
)
def test_each_secret_pattern_is_found_and_hidden(text, kind):
    assert find_secret(text).startswith(kind)
    hidden = redact_text(text)
    assert "***" in hidden and find_secret(hidden) is None


def test_ordinary_text_holds_no_secret():
    for text in ("the bearer of good news", "hf_hub_download", "https://host/shards/{0..7}.tar", "AKIA lowercase"):
        assert find_secret(text) is None, text


def big_shard(tmp_path):
    """One shard of ~1 MB: far more than a pipe's 64 KiB buffer, so a reader that stops after one sample leaves
    its command blocked in a write."""
    rng = np.random.default_rng(0)
    samples = [{"png": noise_image_bytes(rng, size=200), "txt": f"noise {i}"} for i in range(8)]
    write_samples(tmp_path, samples, per_shard=8)
    (shard,) = tmp_path.glob("*.tar")
    assert shard.stat().st_size > 1_000_000
    return shard


def test_a_pipe_reader_stopped_early_says_so_in_one_line_without_the_command(tmp_path, caplog):
    """curl, reading a gated shard, exits 23 when the reader stops before the shard's end (as at the end of a run):
    webdataset raises that from the close, quoting the command and its credential."""
    url = f"pipe:curl -s -H 'Authorization: Bearer {HF_TOKEN}' file://{big_shard(tmp_path)}"
    samples = raw_samples(url)
    first = next(samples)
    shown = f"pipe: {tmp_path.name}/00000.tar"
    assert first["__url__"] == shown
    with caplog.at_level(logging.WARNING, logger="disco_clip_ds.data.streams.tar_samples"):
        samples.close()  # the reader stops: curl's next write fails
    (record,) = caplog.records
    line = record.getMessage()
    assert (
        line
        == f"pipe: {tmp_path.name}/00000.tar: the reading command ended after the reader stopped: the command exited 23"
    )
    assert HF_TOKEN not in line and "curl" not in line and "Bearer" not in line, line


def test_a_failing_pipe_command_is_an_error_without_the_command(tmp_path):
    url = f"pipe:curl -s -f -H 'Authorization: Bearer {HF_TOKEN}' file://{tmp_path}/missing/00000.tar"
    with pytest.raises(OSError) as failed:
        list(raw_samples(url))
    message = str(failed.value)
    # tar may meet the empty stream before the command's status is seen: either way, its exit status and no command
    assert message.startswith("cannot read pipe: missing/00000.tar: "), message
    assert message.endswith("the command exited 37") and message.count("exited") == 1, message
    assert HF_TOKEN not in message and "curl" not in message, message
