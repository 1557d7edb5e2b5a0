"""Stored embeddings whose checksums are consistent but whose contents are not (issue 54, items 8, 9 and 22): sidecars
forged with every checksum made anew, as a hand-edited or foreign file would be. The reader refuses each in one line
naming the sidecar (rows against keys, a key twice, widths against each other, values finite and of unit length, keys
against the shard's own order); a sample `data embed` skipped (no row) is skipped and counted by training; the writer
stores no non-finite row; and, property-tested, whatever a header or its rows hold, reading gives the rows or the
project's one-line DataError naming the file."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disco_clip_ds.data.embeddings import (
    EmbeddingStore,
    Reinforced,
    TeacherFacts,
    check_sidecars,
    read_reinforced,
    shard_facts,
    sidecar_path,
    write_reinforced,
)
from disco_clip_ds.data.reinforced import block_digests, block_rows
from disco_clip_ds.data.sidecar_file import open_sidecar
from disco_clip_ds.data.sidecar_io import _canonical
from disco_clip_ds.data.streams.reinforced import Reinforcement
from disco_clip_ds.data.streams.shards import ShardStream
from disco_clip_ds.errors import DataError
from disco_clip_ds.testing.images import write_shards


def _stored(keys: list[str], shard: str, width: int = 8, text_width: int | None = None) -> Reinforced:
    gen = torch.Generator().manual_seed(len(keys))
    unit = lambda *shape: F.normalize(torch.randn(*shape, generator=gen), dim=-1)
    return Reinforced(
        list(keys),
        [TeacherFacts("t", "T", "clip", 100.0)],
        [unit(len(keys), 1, width)],
        [{c: unit(len(keys), text_width or width) for c in ("txt", "syn0.txt")}],
        None,
        ["txt", "syn0.txt"],
        0,
        "float32",
        None,
        shard_facts(shard),
    )


def forge(path, stored: Reinforced, keys: list[str] | None = None, meta: dict | None = None) -> None:
    """A format-3 sidecar of `stored`'s tensors as they are (no check, no cast), with `keys` and `meta` in its header,
    every checksum (each block's, the header's) made anew: what a reader cannot tell from a sound file by checksums."""
    from safetensors.torch import save

    tensors = {name: t.contiguous() for name, t in stored.tensors().items()}
    rows = block_rows(sum(t[:1].nbytes for t in tensors.values()))
    header = {**stored.header(), "keys": json.dumps(keys if keys is not None else stored.keys), **(meta or {})}
    header.update(block_rows=str(rows), block_xxh3=json.dumps(block_digests(tensors, rows)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_canonical(save(tensors, metadata=header), signed=True))


def _shard(tmp_path, n: int = 6) -> tuple[str, list[str]]:
    (url,) = write_shards(tmp_path / "data", num_shards=1, per_shard=n, seed=3)
    return url, [f"{i:09d}" for i in range(n)]


def _refused(path, url: str, key: str, said: str) -> None:
    """The store's lookup and the whole-file reader both refuse it in one line naming the sidecar."""
    for read in (lambda: EmbeddingStore(path.parent, "t").lookup(url, key), lambda: read_reinforced(path)):
        with pytest.raises(DataError) as error:
            read()
        assert str(path) in str(error.value) and said in str(error.value) and "\n" not in str(error.value)


ROWS_CASES = {
    # before: an IndexError traceback, a ValueError from the loss, and silent training
    "fewer rows than keys": (lambda s: (s, s.keys + ["extra"]), "hold 6 rows for its 7 sample keys"),
    "a key twice": (lambda s: (s, s.keys[:-1] + s.keys[:1]), "name '000000000' twice"),
    "image 32 wide, text 64": (lambda s: (_stored(s.keys, s.meta["shard"], 32, 64), None), "are 32 wide and its text"),
}


@pytest.mark.parametrize("case", list(ROWS_CASES))
def test_a_header_whose_rows_do_not_fit_its_keys_or_widths_is_refused_naming_the_sidecar(tmp_path, case):
    url, keys = _shard(tmp_path)
    alter, said = ROWS_CASES[case]
    stored, forged_keys = alter(_stored(keys, url))
    path = sidecar_path(tmp_path / "emb", url)
    forge(path, stored, forged_keys)
    _refused(path, url, keys[0], said)


VALUE_CASES = {
    "scaled by 1000": (lambda t: t * 1000, "norm 1000"),
    "NaN": (lambda t: t * float("nan"), "a value that is not finite"),
    "inf": (lambda t: t / 0, "a value that is not finite"),
    "zero": (lambda t: t * 0, "norm 0"),
    "half length": (lambda t: t * 0.5, "norm 0.5"),
}


@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_a_row_that_is_not_a_unit_length_teacher_embedding_is_refused_naming_the_sidecar_and_sample(tmp_path, case):
    url, keys = _shard(tmp_path)
    stored = _stored(keys, url)
    alter, said = VALUE_CASES[case]
    stored.texts[0]["syn0.txt"][3] = alter(stored.texts[0]["syn0.txt"][3])  # one row of one tensor
    path = sidecar_path(tmp_path / "emb", url)
    forge(path, stored)
    _refused(path, url, keys[3], said)
    with pytest.raises(DataError, match="text/t/syn0.txt of sample 000000003"):
        read_reinforced(path)
    if case in ("NaN", "inf"):  # the writer stores no non-finite row
        again = tmp_path / "again" / path.name
        with pytest.raises(DataError, match=f"{again}: the embedding text/t/syn0.txt of sample 000000003 is not fin"):
            write_reinforced(again, stored)
        assert not again.exists()


def test_rows_within_the_stored_dtypes_rounding_of_unit_length_are_read(tmp_path):
    url, keys = _shard(tmp_path)
    stored = _stored(keys, url)
    stored.images[0][2] *= 1.015  # inside the tolerance: bfloat16's rounding moves a norm by far less
    path = sidecar_path(tmp_path / "emb", url)
    forge(path, stored)
    assert torch.equal(EmbeddingStore(path.parent, "t").lookup(url, keys[2]).images[0], stored.images[0][2])


def _reinforced_stream(urls: list[str], folder) -> ShardStream:
    return ShardStream(
        urls, 16, seed=1, shuffle_buffer=3, reinforcement=Reinforcement(EmbeddingStore(folder, "t"), 1, False)
    )


def test_keys_rotated_by_one_are_refused_against_the_shards_order(tmp_path):
    """The store finds a row by its key, so a key list rotated by one (each key naming its neighbour's row, every
    checksum made anew) would teach each sample another's embedding; the keys are checked against the order of the
    shard's own samples as the stream reads them."""
    url, keys = _shard(tmp_path)
    path = sidecar_path(tmp_path / "emb", url)
    forge(path, _stored(keys, url), keys[1:] + keys[:1])
    stream = _reinforced_stream([url], tmp_path / "emb")
    with pytest.raises(DataError, match=f"{path}: its sample keys are not in its shard's order"):
        next(iter(stream))
    stored = _stored(keys, url)
    forge(path, stored)  # the same rows under their own keys: read, each row once a pass
    items = [item for _, item in zip(range(6), _reinforced_stream([url], tmp_path / "emb"))]
    assert sorted(tuple(item[2][0][1].tolist()) for item in items) == sorted(
        map(tuple, stored.texts[0]["txt"].tolist())
    )


def test_a_sample_embed_skipped_is_skipped_and_counted_by_training_and_said_at_the_start(tmp_path):
    """A sample `data embed` skipped (a caption key missing) has no row: training skips and counts it on every pass,
    where it used to stop the run (and every resume) at the step that reached it; its sidecar's header records the
    count, which the check before training returns."""
    url, keys = _shard(tmp_path)
    stored = _stored([k for k in keys if k != keys[2]], url)
    stored.meta = {**stored.meta, "skipped": 1}
    write_reinforced(sidecar_path(tmp_path / "emb", url), stored)
    assert check_sidecars(tmp_path / "emb", [url], "t", "T", caption_keys=["txt"]) == 1
    stream = _reinforced_stream([url], tmp_path / "emb")
    items = [item for _, item in zip(range(16), stream)]  # three passes of the 5 stored samples, and one more
    assert len({item[1] for item in items}) == 5 and 3 <= stream.skipped.value <= 4  # once per pass
    assert items[-1][-1].tolist()[2] == stream.skipped.value  # the reader's position row carries its count


def test_sidecars_of_other_widths_in_one_folder_are_refused(tmp_path):
    urls = write_shards(tmp_path / "data", num_shards=2, per_shard=2, seed=3)
    for s, (url, width) in enumerate(zip(urls, (8, 16))):
        write_reinforced(
            sidecar_path(tmp_path / "emb", url), _stored([f"{s:05d}{2 * s + i:04d}" for i in (0, 1)], url, width)
        )
    store = EmbeddingStore(tmp_path / "emb", "t", shards=urls)
    assert store.widths == [8]
    with pytest.raises(DataError, match="embeddings of teacher t are 16 wide, other sidecars' .* 8"):
        store.lookup(urls[1], "000010002")


# --- property tests: any header, any rows ---

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
META_FIELDS = ["format", "keys", "teachers", "caption_keys", "augmentations", "dtype", "seed", "block_rows"]
ENTRY_FIELDS = ["dtype", "shape", "data_offsets"]


@functools.cache
def _sound_file() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sound.teacher.safetensors"
        write_reinforced(path, _stored(["a", "b", "c"], str(Path(tmp) / "00000.tar"), width=4))
        return path.read_bytes()


def _sound() -> tuple[dict, bytes]:
    """A sound sidecar's header (as JSON) and data bytes, to be garbled."""
    data = _sound_file()
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _write(path, header, body: bytes, resign: bool) -> None:
    raw = json.dumps(header, allow_nan=True).encode() if not isinstance(header, bytes) else header
    if resign and isinstance(header, dict) and isinstance(header.get("__metadata__"), dict):
        from disco_clip_ds.data.reinforced import header_digest

        header["__metadata__"]["sha256"] = header_digest(header) if _digestible(header) else "x"
        raw = json.dumps(header, allow_nan=True).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + body)


def _digestible(header) -> bool:
    try:
        json.dumps(header, sort_keys=True)
        return True
    except (TypeError, ValueError):
        return False


GARBLES = st.one_of(
    st.tuples(st.just("meta"), st.sampled_from(META_FIELDS), JSON_VALUES | st.text(max_size=20)),
    st.tuples(st.just("entry"), st.sampled_from(ENTRY_FIELDS), JSON_VALUES),
    st.tuples(st.just("values"), st.sampled_from([float("nan"), float("inf"), 1e30, 0.0, -1.0]), st.integers(0, 11)),
    st.tuples(st.just("cut"), st.integers(0, 200), st.booleans()),
    st.tuples(st.just("raw"), st.binary(max_size=40), st.booleans()),
    st.tuples(st.just("duplicate"), st.sampled_from(["key", "name"]), st.booleans()),
)


@settings(max_examples=25, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbles=st.lists(GARBLES, min_size=1, max_size=3), resign=st.booleans())
def test_any_garbled_header_or_rows_read_or_are_one_line_naming_the_file(tmp_path, garbles, resign):
    header, body = _sound()
    raw = None
    for garble in garbles:
        kind, a, b = garble
        if kind == "meta":
            header["__metadata__"][a] = b if isinstance(b, str) else json.dumps(b) if a == "keys" and b else b
        elif kind == "entry":
            header[sorted(k for k in header if k != "__metadata__")[0]][a] = b
        elif kind == "values":
            values = bytearray(body)
            values[4 * b : 4 * b + 4] = torch.tensor([a], dtype=torch.float32).numpy().tobytes()
            body = bytes(values)
        elif kind == "cut":
            body = body[: max(0, len(body) - a)] if b else body + b"\0" * a
        elif kind == "raw":
            raw = a if b else json.dumps(header).encode()[: len(a)] + a
        elif a == "key":
            header["__metadata__"]["keys"] = json.dumps(["a", "a", "c"])
        else:
            raw = json.dumps(header).encode()[:-1] + b', "__metadata__": {}}'
    path = tmp_path / "garbled.teacher.safetensors"
    _write(path, raw if raw is not None else header, body, resign and raw is None)
    try:
        sidecar = open_sidecar(path)
        try:
            tensors = sidecar.read_all()
        finally:
            sidecar.close()
    except DataError as error:
        message = str(error)
        assert message.startswith(str(path)) and "\n" not in message and len(message) < 600, message
        return
    assert all(torch.isfinite(t).all() for n, t in tensors.items())  # read: rows that passed every check
