"""DataComp's subset files (data/curate/uids.py) against files numpy builds as DataComp's baselines build them
(`np.array([(int(uid[:16], 16), int(uid[16:32], 16)) ...], np.dtype("u8,u8"))`, sorted, `np.save`): read, written
byte for byte alike, matched against samples' uids; every bad file refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disco_clip_ds.data.curate import uids
from disco_clip_ds.errors import DataError, UsageError

HEXES = ["ffffffffffffffff0000000000000001", "00000000000000000000000000000000", "0123456789abcdef0123456789ABCDEF"]


def datacomp_file(path, hexes: list[str]) -> None:
    """A subset file as DataComp's baselines write it (save_uids)."""
    array = np.array([(int(u[:16], 16), int(u[16:32], 16)) for u in hexes], np.dtype("u8,u8"))
    array.sort()
    np.save(path, array)


def test_a_datacomp_file_is_read_sorted(tmp_path):
    datacomp_file(tmp_path / "s.npy", HEXES)
    read = uids.read_uid_file(str(tmp_path / "s.npy"))
    assert read.tolist() == [(0, 0), (0x0123456789ABCDEF, 0x0123456789ABCDEF), (2**64 - 1, 1)]
    np.save(tmp_path / "unsorted.npy", np.array([(2, 0), (1, 9), (1, 3)], np.dtype("u8,u8")))
    assert uids.read_uid_file(str(tmp_path / "unsorted.npy")).tolist() == [(1, 3), (1, 9), (2, 0)]


def test_the_written_file_is_byte_for_byte_datacomps(tmp_path):
    datacomp_file(tmp_path / "theirs.npy", HEXES)
    pairs = [uids.uid_of(json.dumps({"uid": u}).encode()) for u in reversed(HEXES)]
    uids.write_uid_file(tmp_path / "ours.npy", uids.uid_arrays(pairs)["uid"])
    assert (tmp_path / "ours.npy").read_bytes() == (tmp_path / "theirs.npy").read_bytes()
    assert np.load(tmp_path / "ours.npy").dtype == np.dtype("u8,u8")  # what DataComp's resharder checks


def test_a_sample_uid_is_32_hex_digits_under_uid_in_its_json():
    assert uids.uid_of(b'{"uid": "0000000000000001000000000000000a", "key": "x"}') == (1, 10)
    for bad in [None, b"", b"not json", b"[1, 2]", b'{"key": "x"}', b'{"uid": "abc"}', b'{"uid": 12}']:
        assert uids.uid_of(bad) is None
    assert uids.uid_of(json.dumps({"uid": "g" * 32}).encode()) is None


def test_the_list_keeps_exactly_its_uids():
    wanted = np.sort(np.array([(0, 5), (1, 0), (2**64 - 1, 2**64 - 1)], np.dtype("u8,u8")))
    samples = np.array([(1, 0), (0, 5), (0, 6), (2**64 - 1, 2**64 - 1), (1, 0), (3, 3)], np.dtype("u8,u8"))
    has = np.array([True, True, True, True, False, True])  # the fifth has no uid: its zeros mean nothing
    assert uids.kept_by_list(samples, has, wanted).tolist() == [True, True, False, True, False, False]
    assert not uids.kept_by_list(samples, has, wanted[:0]).any()


@pytest.mark.parametrize(
    "array, said",
    [
        (np.array(["0" * 32]), "dtype <U32"),
        (np.zeros((2, 2), np.uint64), "dtype uint64 and shape (2, 2)"),
        (np.zeros((2, 1), np.dtype("u8,u8")), "shape (2, 1)"),
        (np.zeros(2, np.dtype("i8,i8")), "dtype [('f0', '<i8'), ('f1', '<i8')]"),
    ],
)
def test_a_file_of_another_dtype_is_refused_in_one_line(tmp_path, array, said):
    np.save(tmp_path / "x.npy", array)
    with pytest.raises(UsageError, match="not DataComp's uid list") as error:
        uids.check_uid_file(str(tmp_path / "x.npy"))
    assert said in str(error.value) and "\n" not in str(error.value)


def test_a_missing_or_unreadable_file_is_refused_in_one_line(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        uids.check_uid_file(str(tmp_path / "none.npy"))
    (tmp_path / "text.npy").write_text("0123456789abcdef0123456789abcdef\n")
    with pytest.raises(UsageError, match="not a .npy file numpy reads") as error:
        uids.check_uid_file(str(tmp_path / "text.npy"))
    assert "\n" not in str(error.value)


def test_a_shard_without_uids_is_named():
    uids.check_uids("a/00000.tar", np.ones(3, bool))
    with pytest.raises(DataError, match=r"shard a/00001.tar has 2 of 3 samples without a uid"):
        uids.check_uids("a/00001.tar", np.array([True, False, False]))


@settings(max_examples=15, derandomize=True, deadline=None)
@given(st.lists(st.integers(0, 2**128 - 1), max_size=8), st.binary(max_size=40))
def test_any_uids_round_trip_as_datacomp_builds_them_and_hostile_json_reads_as_none(values, junk):
    hexes = [f"{v:032x}" for v in values]
    pairs = [uids.uid_of(json.dumps({"uid": h}).encode()) for h in hexes]
    built = np.array([(int(u[:16], 16), int(u[16:32], 16)) for u in hexes], np.dtype("u8,u8"))
    assert np.array_equal(uids.uid_arrays(pairs)["uid"], built) if hexes else not pairs
    assert uids.uid_of(junk) is None or len(json.loads(junk)["uid"]) == 32
