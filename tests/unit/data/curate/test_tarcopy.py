"""The filter's copy path (data/tarcopy.py) against Python's tarfile, its reference: headers built from the
template are tarfile's own, a written shard is the bytes tarfile's writer gives the same members, the samples located
by the headers are the ones `raw_samples` (tarfile) reads, and a shard the fast path does not follow (GNU long names,
damage) is left to tarfile, so that `write_output_shard` gives the reference bytes either way."""

from __future__ import annotations

import hashlib
import io
import tarfile

import numpy as np
import pytest

from disco_clip_ds.data.curate.reshard import write_output_shard
from disco_clip_ds.data.embeddings import read_metadata, sidecar_path
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.data.tarcopy import SharedBytes, TarWriter, sample_members

from unit.data.curate.shardsets import embedded_shards

NAMES = ["a.jpg", "x" * 100, "x" * 96 + ".jpg", "x" * 101, "dir/sub/k.txt", "é.jpg", "k.JSON"]
SIZES = [0, 1, 511, 512, 513, 123_456, 8**11 - 1, 8**11]


def _reference_info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)  # what reshard wrote with tarfile before tarcopy
    info.size, info.mtime, info.mode = size, 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _reference_tar(members: list[tuple[str, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            tar.addfile(_reference_info(name, len(data)), io.BytesIO(data))
    return buffer.getvalue()


def test_each_header_is_the_one_tarfile_writes():
    writer = TarWriter.__new__(TarWriter)  # the header alone: no file
    for name in NAMES:
        for size in SIZES:
            expected = _reference_info(name, size).tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
            assert writer._header(name, size) == expected, (name, size)


def test_a_written_shard_is_tarfiles_bytes_and_its_sha256(tmp_path):
    rng = np.random.default_rng(0)
    members = [(name, rng.bytes(size)) for name, size in zip(NAMES, [0, 1, 511, 512, 513, 3000, 7])]
    for count in (0, 1, 7, 19):  # the end record padded from several offsets
        members_now = (members * 3)[:count]
        writer = TarWriter(tmp_path / "out.tar")
        for name, data in members_now:
            writer.add(name, data)
        digest = writer.close()
        expected = _reference_tar(members_now)
        assert (tmp_path / "out.tar").read_bytes() == expected, count
        assert digest == hashlib.sha256(expected).hexdigest()


def _located(url: str) -> list[tuple[str, list[tuple[str, bytes]]]]:
    found, source = sample_members(url), SharedBytes(url)
    try:
        return [(found.keys[i], [(e, source.read(o, s)) for e, o, s in found.members(i)]) for i in range(len(found))]
    finally:
        source.close()


def _read(url: str) -> list[tuple[str, list[tuple[str, bytes]]]]:
    return [(s["__key__"], [(k, v) for k, v in s.items() if not k.startswith("__")]) for s in raw_samples(url)]


def _write_tar(path, members, fmt=tarfile.PAX_FORMAT, mtime=1.5):
    with tarfile.open(path, "w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = (len(data), mtime) if data is not None else (0, mtime)
            if data is None:
                info.type = tarfile.DIRTYPE
            tar.addfile(info, io.BytesIO(data or b""))


MIXED = [
    ("k0.jpg", b"\xff\xd8jpeg0"),
    ("k0.TXT", b"caption zero"),  # upper case: the extension "txt", as raw_samples lowercases it
    ("dir", None),  # a directory: passed over
    ("__meta__", b"{}"),  # webdataset's metadata: passed over
    ("noext", b"x"),  # no extension: passed over
    ("sub/k1.seg.jpg", b"jpeg1" * 200),  # key sub/k1, extension seg.jpg
    ("sub/k1.txt", b""),
    ("p" * 120 + "/k2.jpg", b"long path"),  # pax path (PAX), ustar prefix (USTAR)
    ("ké3.jpg", "non-ascii".encode()),  # pax path (PAX)
]


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_the_samples_located_by_the_headers_are_the_ones_tarfile_reads(tmp_path, fmt):
    members = MIXED if fmt == tarfile.PAX_FORMAT else [m for m in MIXED if m[0].isascii() and "ké" not in m[0]]
    url = str(tmp_path / "mixed.tar")
    _write_tar(url, members, fmt, mtime=1.5 if fmt == tarfile.PAX_FORMAT else 7)  # a float mtime: a pax record
    assert sample_members(url) is not None
    assert _located(url) == _read(url) and len(_read(url)) == (4 if fmt == tarfile.PAX_FORMAT else 3)
    urls = embedded_shards(tmp_path / "wds", 1, 5)  # webdataset's writer
    assert _located(urls[0]) == _read(urls[0])


def test_a_shard_the_fast_path_does_not_follow_is_left_to_tarfile(tmp_path):
    url = str(tmp_path / "gnu.tar")
    _write_tar(url, [("q" * 120 + ".jpg", b"gnu long name"), ("k.jpg", b"a")], tarfile.GNU_FORMAT)  # type L
    assert sample_members(url) is None and len(_read(url)) == 2
    good = str(tmp_path / "good.tar")
    _write_tar(good, MIXED)
    data = open(good, "rb").read()
    with tarfile.open(good) as tar:
        infos = tar.getmembers()
    end = infos[-1].offset_data + infos[-1].size
    damaged = {
        "cut at a member": data[: infos[5].offset],
        "cut in a member's data": data[: infos[5].offset_data + 3],
        "one zero block of two": data[: -(-end // 512) * 512 + 512],
        "garbage after the end": data + b"x",
        "a header byte flipped": data[:100] + bytes([data[100] ^ 1]) + data[101:],
        "empty": b"",
    }
    for what, content in damaged.items():
        open(url, "wb").write(content)
        assert sample_members(url) is None, what  # raw_samples then says what is wrong
        with pytest.raises((tarfile.TarError, ValueError)):
            list(raw_samples(url))


def test_the_output_shard_is_the_reference_writers_on_plain_and_other_shards(tmp_path):
    """write_output_shard against a writer built here on tarfile and raw_samples (the one before tarcopy), with one
    piece located by the headers and one (GNU long names) read by raw_samples."""
    urls = embedded_shards(tmp_path / "in", 2, 5)
    gnu = tmp_path / "in" / "00001.tar"
    with tarfile.open(gnu) as tar:
        members = [(info.name, tar.extractfile(info).read()) for info in tar.getmembers()]
    members.insert(4, ("z" * 120, b"a long name without an extension: passed over, in a GNU L member"))
    _write_tar(gnu, members, tarfile.GNU_FORMAT)  # the same samples, other headers: left to raw_samples
    assert sample_members(urls[0]) is not None and sample_members(str(gnu)) is None
    pieces = [(urls[0], sidecar_path(tmp_path / "in", urls[0]), [0, 3, 4]), (urls[1], None, [1, 2])]
    expected = []
    for url, _, wanted in pieces:
        for index, sample in enumerate(raw_samples(url)):
            if index in wanted:
                expected += [(f"{sample['__key__']}.{k}", v) for k, v in sample.items() if not k.startswith("__")]
    reference = _reference_tar(expected)
    out = tmp_path / "out" / "00000.tar"
    out.parent.mkdir()
    pieces[1] = (urls[1], sidecar_path(tmp_path / "in", urls[1]), [1, 2])
    # the sidecar of the rewritten shard records the old size: only the rows are read from it here
    assert write_output_shard(out, pieces) == 5
    assert out.read_bytes() == reference
    meta = read_metadata(sidecar_path(out.parent, str(out)))
    assert meta["shard_sha256"] == hashlib.sha256(reference).hexdigest()
    # the same with the scan's table for the first piece
    located = sample_members(urls[0])
    write_output_shard(out, [(*pieces[0], located), pieces[1]])
    assert out.read_bytes() == reference
