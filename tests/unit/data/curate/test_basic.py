"""DataComp's basic filter (data/curate/basic.py, language.py): each rule on hand-computed cases, at DataComp's
thresholds and either side of them; the image size from img2dataset's .json (original_* first) or from the image's
header alone, never a decode; the flags' resolution; a language the model does not label refused in one line."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from disco_clip_ds.data.curate import basic
from disco_clip_ds.data.curate.language import known_languages, language_of
from disco_clip_ds.errors import UsageError
from disco_clip_ds.testing.images import declaring_size, image_bytes


def _cfg(**given):
    fields = dict.fromkeys(basic.DATACOMP)
    return SimpleNamespace(**{**fields, "basic_filter": False, "target": [], **given})


def _facts(captions=None, sizes=None) -> dict:
    """load_facts' arrays for captions (language from the model) and (width, height) pairs."""
    facts = {}
    if captions is not None:
        rows = [basic.caption_facts(c) for c in captions]
        facts["in_language"] = np.array([r[0] == "en" for r in rows])
        facts["words"], facts["chars"] = np.array([r[1] for r in rows]), np.array([r[2] for r in rows])
    if sizes is not None:
        facts["width"], facts["height"] = np.array(sizes, np.int64).T
    return facts


def test_captions_in_other_languages_are_dropped_by_the_language_rule():
    captions = [
        "a photo of a dog on the beach",
        "ein Hund spielt am Strand",  # German
        "un chien joue sur la plage",  # French
        "un perro juega en la playa",  # Spanish
        "海滩上的狗",  # Chinese
        "собака на пляже",  # Russian
        "a red car parked\nin the street",  # a newline, as DataComp: read as a space
    ]
    assert [language_of(c) for c in captions] == ["en", "de", "fr", "es", "zh", "ru", "en"]
    dropped = basic.drops({"caption_language": "en"}, _facts(captions))["caption_language"]
    assert dropped.tolist() == [False, True, True, True, True, True, False]


def test_word_and_character_counts_at_datacomp_thresholds():
    captions = ["two words", "three small words", "a b c", "abc de", "  spaced\tout  words ", "ab cd ef", "abcde f"]
    # words = text.split(): 2, 3, 3, 2, 3, 3, 2; characters = len(text): 9, 17, 5, 6, 20, 8, 7
    facts = _facts(captions)
    assert facts["words"].tolist() == [2, 3, 3, 2, 3, 3, 2] and facts["chars"].tolist() == [9, 17, 5, 6, 20, 8, 7]
    out = basic.drops({"caption_words_over": 2, "caption_chars_over": 5}, facts)
    assert out["caption_words"].tolist() == [True, False, False, True, False, False, True]  # more than 2 words
    assert out["caption_chars"].tolist() == [False, False, True, False, False, False, False]  # more than 5 chars
    prefilter = basic.drops({"caption_words_over": 1}, facts)["caption_words"]  # the image-based baseline's
    assert not prefilter.any()


def test_a_sample_without_caption_fails_every_caption_rule():
    assert basic.caption_facts(None) == ("", -1, -1)
    facts = {"in_language": np.array([False]), "words": np.array([-1]), "chars": np.array([-1])}
    out = basic.drops({"caption_language": "en", "caption_words_over": 0, "caption_chars_over": 0}, facts)
    assert all(mask.tolist() == [True] for mask in out.values())


def test_small_and_extreme_aspect_images_at_datacomp_thresholds():
    sizes = [(200, 200), (199, 400), (600, 200), (601, 200), (200, 700), (1000, 300), (-1, -1), (640, 213)]
    out = basic.drops({"min_image_side": 200, "max_aspect_ratio": 3.0}, _facts(sizes=sizes))
    assert out["image_side"].tolist() == [False, True, False, False, False, False, True, False]
    # ratios 1, 2.01, 3, 3.005, 3.5, 3.33, unknown, 3.0047
    assert out["aspect_ratio"].tolist() == [False, False, False, True, True, True, True, True]


def test_the_size_is_the_original_one_when_the_json_has_it():
    image = image_bytes(size=(64, 64))
    original = {"width": 64, "height": 64, "original_width": 1024, "original_height": 256}
    assert basic.image_size(original, image) == (1024, 256)
    assert basic.image_size({"width": 64, "height": 48}, None) == (64, 48)  # img2dataset without original_*
    assert basic.image_size({"original_width": None, "original_height": 5, "width": 7, "height": 9}, None) == (7, 9)
    assert basic.image_size({}, image_bytes(size=(90, 30))) == (90, 30)  # no size in the json: the header
    assert basic.image_size({}, None) == (-1, -1) and basic.image_size({}, b"not an image") == (-1, -1)


def test_the_header_alone_is_read_never_the_pixels():
    jpeg = image_bytes(size=(300, 100))
    start = jpeg.index(b"\xff\xda")  # start of scan: what follows is the entropy-coded pixel data
    garbage = jpeg[: start + 20] + bytes(range(256)) * 4  # a valid header, then garbage and no end marker
    with pytest.raises(OSError):
        Image.open(io.BytesIO(garbage)).load()  # a decode fails
    assert basic.image_size({}, garbage) == (300, 100)
    assert basic.image_size({}, declaring_size("PNG", (9_000, 3_000))) == (9_000, 3_000)  # 16 x 16 pixels inside
    assert basic.image_size({}, declaring_size("JPEG", (300, 4_000))) == (300, 4_000)
    # above PIL's own bomb limit its header is refused: no size, so both image rules drop it (training would too)
    assert basic.image_size({}, declaring_size("PNG", (30_000, 20_000))) == (-1, -1)


def test_sample_facts_reads_an_image_only_when_the_json_has_no_size():
    read = []

    def sample(meta: dict | None, caption: bytes | None, image: bytes | None):
        members = {"json": None if meta is None else json.dumps(meta).encode(), "txt": caption, "jpg": image}
        return lambda ext: read.append(ext) or members.get(ext)

    uid = "0123456789abcdef" * 2
    samples = [
        sample({"uid": uid, "original_width": 400, "original_height": 100}, b"a dog on a sofa", b"unread"),
        sample(None, "ein Hund auf dem Sofa".encode(), image_bytes(size=(50, 60))),
    ]
    facts = basic.sample_facts(samples, captions=True, sizes=True)
    assert read.count("jpg") == 1  # the first sample's size came from its json
    table = facts["languages"].tobytes().decode().split("\0")
    assert [table[i] for i in facts["language"]] == ["en", "de"] and facts["words"].tolist() == [5, 5]
    assert facts["width"].tolist() == [400, 50] and facts["height"].tolist() == [100, 60]
    assert facts["has_uid"].tolist() == [True, False] and facts["uid"][0].tolist() == (0x0123456789ABCDEF,) * 2


def test_the_flags_resolve_to_datacomp_values_the_prefilter_and_the_given_parts():
    assert basic.thresholds(_cfg()) == {}
    assert basic.thresholds(_cfg(basic_filter=True)) == basic.DATACOMP
    assert basic.thresholds(_cfg(target=["t"])) == {"caption_language": "en", "caption_words_over": 1} | {
        "caption_chars_over": 5
    }
    assert basic.thresholds(_cfg(basic_filter=True, min_image_side=64))["min_image_side"] == 64
    assert basic.thresholds(_cfg(max_aspect_ratio=2.0)) == {"max_aspect_ratio": 2.0}
    assert basic.thresholds(_cfg(target=["t"], caption_language="any")) == {"caption_words_over": 1} | {
        "caption_chars_over": 5
    }
    assert basic.needs(basic.DATACOMP) == (True, True) and basic.needs({"min_image_side": 1}) == (False, True)


@pytest.mark.parametrize(
    "given, said",
    [
        ({"caption_language": "english"}, "--caption_language english: not a language the language-ID model"),
        ({"caption_language": "xx"}, "--caption_language xx: not a language"),
        ({"caption_words_over": -1}, "--caption_words_over -1: give a count of 0 or more"),
        ({"min_image_side": 0}, "--min_image_side 0: give a number of pixels"),
        ({"max_aspect_ratio": 0.5}, "--max_aspect_ratio 0.5: give a ratio of 1 or more"),
    ],
)
def test_bad_thresholds_are_refused_in_one_line(given, said):
    with pytest.raises(UsageError, match=said) as error:
        basic.check_thresholds(_cfg(**given))
    assert "\n" not in str(error.value)


def test_the_model_labels_176_languages():
    known = known_languages()
    assert len(known) == 176 and {"en", "de", "zh", "ja", "sw"} <= known


def test_a_saved_scan_without_the_facts_is_scanned_again():
    assert not basic.scanned({"keys": 0}, False, False)  # made before uids were read
    assert basic.scanned({"has_uid": 0}, False, False) and not basic.scanned({"has_uid": 0}, True, False)
    assert basic.scanned({"has_uid": 0, "words": 0, "width": 0}, True, True)
    assert not basic.scanned({"has_uid": 0, "words": 0}, True, True)
