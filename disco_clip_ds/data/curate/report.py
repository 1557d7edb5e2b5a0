"""What the filter did, sample by sample and in sum: a parquet of every input key (DataComp's uid-list form, with the
reason) and a summary of kept and dropped samples by rule, printed and written as JSON.

Parquet columns: shard (the input shard as given), key, clip_score (float32; null for a sample the teacher never
embedded), cluster (int32; null without --target), dropped_by (the first rule, in RULES order, that drops the sample;
null when kept). One row group per input shard, rows in shard order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from disco_clip_ds.atomic import Stage
from disco_clip_ds.data.curate.reshard import MIN_SHARDS

# the rules in the order `dropped_by` names the first that drops a sample
RULES = (
    "no_embedding",
    "keep_uids",
    *("caption_language", "caption_words", "caption_chars", "image_side", "aspect_ratio"),  # basic.py's
    *("clip_score_min", "keep_fraction", "target", "dedup_against", "dedup", "semdedup", "balance"),
)

SCHEMA_FIELDS = (("shard", "string"), ("key", "string"), ("clip_score", "float32"), ("cluster", "int32"))


def first_rule(drops: dict[str, np.ndarray], n: int) -> np.ndarray:
    """Per sample, the index in RULES of the first rule whose mask in `drops` drops it, -1 when none does."""
    reason = np.full(n, -1, np.int8)
    for code, rule in reversed(list(enumerate(RULES))):  # the first rule written last wins
        if rule in drops:
            reason[drops[rule]] = code
    return reason


class ReportWriter:
    """Writes the parquet one input shard at a time (a row group each), to a temporary file renamed by `close`."""

    def __init__(self, path: Path):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.stage = Stage(path)
        fields = [pa.field(name, getattr(pa, kind)()) for name, kind in SCHEMA_FIELDS]
        self.schema = pa.schema([*fields, pa.field("dropped_by", pa.string())])
        self.writer = pq.ParquetWriter(str(self.stage.tmp), self.schema)

    def add(self, shard: str, keys: list[str], scores: np.ndarray, clusters: np.ndarray | None, reason: np.ndarray):
        """Append an input shard's rows: its keys, scores (NaN: not embedded), clusters, first-rule codes."""
        import pyarrow as pa

        n = len(keys)
        columns = [
            pa.array([shard] * n, pa.string()),
            pa.array(keys, pa.string()),
            pa.array(scores, pa.float32(), mask=np.isnan(scores)),
            pa.nulls(n, pa.int32()) if clusters is None else pa.array(clusters, pa.int32(), mask=clusters < 0),
            pa.array([RULES[c] if c >= 0 else None for c in reason], pa.string()),
        ]
        self.writer.write_table(pa.Table.from_arrays(columns, schema=self.schema))

    def close(self) -> None:
        self.writer.close()
        self.stage.commit()


def summarize(reason: np.ndarray) -> dict:
    """{"samples", "kept", "dropped": {rule: samples it was the first to drop}} of the first-rule codes."""
    counts = np.bincount(reason[reason >= 0].astype(np.int64), minlength=len(RULES))
    return {
        "samples": int(len(reason)),
        "kept": int((reason < 0).sum()),
        "dropped": {rule: int(counts[code]) for code, rule in enumerate(RULES) if counts[code]},
    }


def kept_by_rule(drops: dict[str, np.ndarray]) -> dict[str, int]:
    """{rule: the samples it keeps on its own, of all samples}, in RULES order (a rule that reads the embeddings
    leaves a sample without them to no_embedding, so counts it as kept)."""
    return {rule: int((~drops[rule]).sum()) for rule in RULES if rule in drops}


def summary_line(summary: dict) -> str:
    """The line `data filter` prints of its summary: kept, each rule's count and share of the input samples, and
    what each rule keeps on its own."""
    share = _share(summary["samples"])
    dropped = ", ".join(f"{n} ({share(n)}) by {rule}" for rule, n in summary["dropped"].items()) or "none"
    alone = ", ".join(f"{n} by {rule}" for rule, n in summary.get("kept_by_rule", {}).items())
    return (
        f"{summary['kept']} of {summary['samples']} samples ({share(summary['kept'])}) kept in "
        f"{summary['output_shards']} shards of up to {summary['samples_per_shard']}; dropped: {dropped}"
        + (f"; each rule alone keeps {alone}" if alone else "")
    )


# a copy rule that drops more than this share of the samples is more likely loose than right: eval sets and web
# pools share a copy in well under a per cent of their images (DataComp: ~0.1 %)
COPY_SHARE_WARNING = 0.03
READERS_PER_RANK = 2  # training's default --dataloader_num_workers: the readers of a run on one rank


def warnings(summary: dict, threshold: int, default_threshold: int) -> list[str]:
    """The lines `data filter` warns with after its summary: a copy rule that dropped more than COPY_SHARE_WARNING of
    the samples (its threshold likely too loose for these images), and an output of fewer shards than a training run
    on one 8-GPU node has readers, when the kept samples allow more."""
    lines = []
    share = _share(summary["samples"])
    for rule in ("dedup_against", "dedup"):
        n = summary["dropped"].get(rule, 0)
        if n > COPY_SHARE_WARNING * summary["samples"]:
            which = "the default" if threshold == default_threshold else f"default {default_threshold}"
            lines.append(
                f"--{rule} dropped {n} of {summary['samples']} samples ({share(n)}) as copies at --dedup_threshold "
                f"{threshold} ({which}): above {COPY_SHARE_WARNING:.0%} the threshold is likely too loose for these "
                "images (small or simple images lie a few bits apart); check filter.parquet's dropped samples and "
                "give a lower --dedup_threshold (docs/data.md, Dedup against eval sets)"
            )
    shards, kept = summary["output_shards"], summary["kept"]
    if 0 < shards < MIN_SHARDS and kept > shards:
        lines.append(
            f"{shards} output shard(s) of up to {summary['samples_per_shard']} samples: training reads a shard per "
            f"reader (ranks x --dataloader_num_workers, {READERS_PER_RANK} a rank by default) and refuses a run of "
            f"more than {shards} readers on them; a smaller --samples_per_shard writes more shards"
        )
    return lines


def _share(total: int):
    return lambda n: f"{100 * n / total:.1f} %" if total else "0 %"
