"""DataComp's basic filter, rule by rule, and the facts of each sample it needs, read in the filter's per-shard scan.

DataComp's `basic` baseline keeps a sample whose caption fastText's lid.176 labels English (language.py), has more
than 2 words (`len(text.split())`) and more than 5 characters (`len(text)`), and whose image's smaller side is at least
200 pixels with an aspect ratio (longer side / shorter side) of at most 3, by the image's size before img2dataset
resized it (`original_width`, `original_height`). Its image-based baseline first keeps the captions that are English,
of more than 1 word and more than 5 characters (`caption_filter`), then clusters: `--target` applies that pre-filter.

Each rule is a flag whose default is DataComp's value (`DATACOMP`): `--basic_filter` turns all five on, a flag alone
turns its own rule on. The image's size comes from the sample's `.json` (img2dataset's original_width/height, else
width/height), else from the image's header (decode.EncodedImage reads it without decoding a pixel); a sample whose
size cannot be read (no size, a header that does not read, one above PIL's decompression-bomb limit, which training
refuses too) fails both image rules, as a missing size fails DataComp's comparisons.
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np

from disco_clip_ds.data.curate import language as lang
from disco_clip_ds.data.curate.uids import uid_arrays, uid_in
from disco_clip_ds.data.shards import IMAGE_EXTS
from disco_clip_ds.data.streams.shards import TEXT_KEYS
from disco_clip_ds.errors import UsageError

# flag -> DataComp's value (baselines/utils.py, load_uids_with_basic_filter_helper)
DATACOMP = {
    "caption_language": "en",
    "caption_words_over": 2,
    "caption_chars_over": 5,
    "min_image_side": 200,
    "max_aspect_ratio": 3.0,
}
PREFILTER = {"caption_language": "en", "caption_words_over": 1, "caption_chars_over": 5}  # the image-based baseline's
RULE_OF = {  # flag -> the rule's name in the report (report.RULES)
    "caption_language": "caption_language",
    "caption_words_over": "caption_words",
    "caption_chars_over": "caption_chars",
    "min_image_side": "image_side",
    "max_aspect_ratio": "aspect_ratio",
}
CAPTION_FLAGS = ("caption_language", "caption_words_over", "caption_chars_over")
IMAGE_FLAGS = ("min_image_side", "max_aspect_ratio")
UNKNOWN = -1  # a width, height or count the scan could not read


def thresholds(cfg) -> dict:
    """{flag: value} of the basic rules in force: DataComp's five with --basic_filter, its caption pre-filter with
    --target, and each flag given (its value over those); --caption_language any turns the language rule off."""
    values = dict(DATACOMP) if cfg.basic_filter else dict(PREFILTER) if cfg.target else {}
    values.update({flag: getattr(cfg, flag) for flag in DATACOMP if getattr(cfg, flag) is not None})
    if values.get("caption_language") == lang.ANY:
        del values["caption_language"]
    return values


def check_thresholds(cfg) -> None:
    """Each value in range, in one line."""
    for flag in ("caption_words_over", "caption_chars_over"):
        if getattr(cfg, flag) is not None and getattr(cfg, flag) < 0:
            raise UsageError(f"--{flag} {getattr(cfg, flag)}: give a count of 0 or more")
    if cfg.min_image_side is not None and cfg.min_image_side < 1:
        raise UsageError(f"--min_image_side {cfg.min_image_side}: give a number of pixels, 1 or more")
    if cfg.max_aspect_ratio is not None and not cfg.max_aspect_ratio >= 1:
        raise UsageError(f"--max_aspect_ratio {cfg.max_aspect_ratio}: give a ratio of 1 or more (longer / shorter)")
    if cfg.caption_language is not None:
        lang.check_language(cfg.caption_language)


def needs(values: dict) -> tuple[bool, bool]:
    """(the captions' facts, the images' sizes): what the scan reads for these rules."""
    return any(f in values for f in CAPTION_FLAGS), any(f in values for f in IMAGE_FLAGS)


# --- the scan: per-sample facts ---


def caption_facts(text: str | None) -> tuple[str, int, int]:
    """(language code, words, characters) of a caption, DataComp's way; ("", -1, -1) for a sample without one."""
    if text is None:
        return "", UNKNOWN, UNKNOWN
    return lang.language_of(text), len(text.split()), len(text)


def image_size(meta: dict, image: bytes | None) -> tuple[int, int]:
    """(width, height) of a sample's image: img2dataset's original_width/height in its .json, else width/height,
    else the image's header; (-1, -1) when none is readable."""
    size = _json_size(meta)
    if size is not None:
        return size
    if image is None:
        return UNKNOWN, UNKNOWN
    from disco_clip_ds.data.decode import BadImage, EncodedImage

    try:
        return EncodedImage(image, max_pixels=sys.maxsize).size  # the header alone; no cap: only its size is read
    except BadImage:
        return UNKNOWN, UNKNOWN


def sample_facts(samples, captions: bool, sizes: bool) -> dict[str, np.ndarray]:
    """The scan's arrays of every sample: uids (uids.py) always; language, words, chars with `captions`; width,
    height with `sizes`. `samples` yields, per sample, a function giving a member's bytes by extension (None when
    the sample has none), so that an image is read only when its .json gives no size."""
    uids, languages, words, chars, widths, heights = [], [], [], [], [], []
    for member in samples:
        meta = _meta(member("json"))
        uids.append(uid_in(meta))
        if captions:
            text = _first(member, TEXT_KEYS)
            code, n_words, n_chars = caption_facts(None if text is None else text.decode("utf-8", "replace"))
            languages.append(code)
            words.append(n_words)
            chars.append(n_chars)
        if sizes:
            width, height = image_size(meta, None if _json_size(meta) else _first(member, IMAGE_EXTS))
            widths.append(width)
            heights.append(height)
    arrays = uid_arrays(uids)
    if captions:
        table = sorted(set(languages))
        index = {code: i for i, code in enumerate(table)}
        arrays["language"] = np.array([index[c] for c in languages], np.uint8)
        arrays["languages"] = np.frombuffer("\0".join(table).encode(), np.uint8)
        arrays["words"], arrays["chars"] = np.array(words, np.int32), np.array(chars, np.int32)
    if sizes:
        arrays["width"], arrays["height"] = np.array(widths, np.int64), np.array(heights, np.int64)
    return arrays


def scanned(saved, captions: bool, sizes: bool) -> bool:
    """Whether a saved scan holds the facts these rules need (a scan made before they were read has none)."""
    return "has_uid" in saved and (not captions or "words" in saved) and (not sizes or "width" in saved)


def _first(member, extensions) -> bytes | None:
    for ext in extensions:
        data = member(ext)
        if data is not None:
            return data
    return None


def _json_size(meta: dict) -> tuple[int, int] | None:
    """original_width/height, else width/height, when the .json holds both as whole numbers."""
    for w, h in (("original_width", "original_height"), ("width", "height")):
        width, height = meta.get(w), meta.get(h)
        if _number(width) and _number(height):
            return int(width), int(height)
    return None


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _meta(raw: bytes | None) -> dict:
    try:
        meta = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return meta if isinstance(meta, dict) else {}


def shard_samples(url: str, located=None):
    """Each sample of local shard `url` in order, as a function of an extension giving that member's bytes (None when
    the sample has none): read where each member lies (tarcopy.Members, `located` or found now), one small read a
    member asked for; a shard tarcopy leaves to tarfile is read whole by `raw_samples`."""
    from disco_clip_ds.data.streams.tar_samples import raw_samples
    from disco_clip_ds.data.tarcopy import SharedBytes, sample_members

    located = located or sample_members(url)
    if located is None:
        yield from (sample.get for sample in raw_samples(url))
        return
    source = SharedBytes(url)
    try:
        for i in range(len(located)):
            where = {ext: (offset, size) for ext, offset, size in located.members(i)}
            yield lambda ext, where=where: source.read(*where[ext]) if ext in where else None
    finally:
        source.close()


# --- the decision ---


def drops(values: dict, facts: dict) -> dict[str, np.ndarray]:
    """{rule: mask of the samples it drops} of the basic rules in force, from the scans' facts (`load_facts`)."""
    out = {}
    if "caption_language" in values:
        out["caption_language"] = ~facts["in_language"]
    if "caption_words_over" in values:
        out["caption_words"] = ~(facts["words"] > values["caption_words_over"])
    if "caption_chars_over" in values:
        out["caption_chars"] = ~(facts["chars"] > values["caption_chars_over"])
    if IMAGE_FLAGS[0] in values or IMAGE_FLAGS[1] in values:
        short = np.minimum(facts["width"], facts["height"])
        long = np.maximum(facts["width"], facts["height"])
        known = short > 0
        if "min_image_side" in values:
            out["image_side"] = ~(known & (short >= values["min_image_side"]))
        if "max_aspect_ratio" in values:
            ratio = long / np.where(known, short, 1)  # float64, as DataComp's pandas division
            out["aspect_ratio"] = ~(known & (ratio <= values["max_aspect_ratio"]))
    return out


def load_facts(scans, values: dict) -> dict[str, np.ndarray]:
    """The facts the rules in force need, every shard's concatenated: `in_language` (bool), words, chars, width,
    height."""
    captions, sizes = needs(values)
    parts: dict[str, list] = {"in_language": [], "words": [], "chars": [], "width": [], "height": []}
    for scan in scans:
        with np.load(scan) as saved:
            if captions:
                table = saved["languages"].tobytes().decode().split("\0")
                wanted = [i for i, code in enumerate(table) if code == values.get("caption_language")]
                parts["in_language"].append(np.isin(saved["language"], wanted))
                parts["words"].append(saved["words"])
                parts["chars"].append(saved["chars"])
            if sizes:
                parts["width"].append(saved["width"])
                parts["height"].append(saved["height"])
    return {k: np.concatenate(v) for k, v in parts.items() if v}
