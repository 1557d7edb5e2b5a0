"""`disco-clip data filter`: scan -> decide -> write.

Steps 1 and 3 (and --target's assignment of each shard) run as tasks on runner.py's runner: `--processes` worker
processes, or Spark tasks (`--spark`); step 2 runs here, on the driver.

1. Scan, a task per input shard: its keys and where each member lies (from the tar's
   headers, data/tarcopy.py, kept for the write), each sample's CLIP score (from its sidecar) and, for the dedup
   rules, its image fingerprint (the one step that decodes images); with --metadata, its caption's metadata entries.
   The result is saved per shard (OUTPUT/.filter/scan/NNNNN.npz, written atomically: atomic.py); a
   re-run keeps a saved scan whose sidecar and shard are unchanged (an unreadable one is scanned again).
2. Decide, in this process, from the scans: every rule's mask (scores, image clusters, copies), intersected; then
   SemDeDup (semdedup.py) and MetaCLIP's balancing (balance.py), each among the samples the rules before it keep. It
   holds a float32 score per sample (and an int32 cluster, a fingerprint, with those rules), never an image.
3. Write, a task per output shard: the kept samples, byte for byte, and their sidecar (reshard.py); a re-run keeps an
   output shard that is complete and verifies. Then sizes.json, the parquet of every input key and the summary.

The same inputs and arguments give byte-identical outputs, whatever --processes or --spark: every order is the input
order (shards as --shards lists them, samples in shard order), and the k-means is seeded.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from disco_clip_ds import faults
from disco_clip_ds.atomic import remove_leftovers, write_bytes
from disco_clip_ds.data.curate import balance, basic, inputs, reshard, runner, scores, semdedup, uids
from disco_clip_ds.data.curate import clusters as cl
from disco_clip_ds.data.curate.report import ReportWriter, first_rule, kept_by_rule, summarize
from disco_clip_ds.data.embeddings import read_metadata, read_sidecar
from disco_clip_ds.data.shards import IMAGE_EXTS, write_json
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.data.tarcopy import Members, sample_members
from disco_clip_ds.distributed.runlock import writer_lock
from disco_clip_ds.errors import DataError, UsageError

logger = logging.getLogger("disco_clip_ds.data.curate")
STATE = ".filter"  # the scans and the k-means centres of a run, kept for its resume


@dataclass
class FilterConfig:
    """`disco-clip data filter`'s arguments (commands/data.py parses them; see its --help)."""

    shards: str
    output: str
    embeddings: str | None = None
    teacher: str | None = None
    tokenizer_name: str | None = None
    clip_score_min: float | None = None
    keep_fraction: float | None = None
    clusters: int | None = None
    kmeans_sample: int = 1_000_000
    target: list[str] = field(default_factory=list)
    dedup_against: list[str] = field(default_factory=list)
    dedup: bool = False
    dedup_threshold: int | None = None
    metadata: str | None = None
    balance_t: float | None = None
    semdedup_eps: float | None = None
    semdedup_clusters: int = 100
    samples_per_shard: int | None = None  # None: reshard.shard_size's default
    processes: int = 1
    seed: int = 0
    basic_filter: bool = False  # DataComp's basic filter (basic.py): the five flags below at DataComp's values
    caption_language: str | None = None
    caption_words_over: int | None = None
    caption_chars_over: int | None = None
    min_image_side: int | None = None
    max_aspect_ratio: float | None = None
    keep_uids: str | None = None  # a DataComp subset file (uids.py)
    spark: str | None = None  # a master URL; "": the active, spark-submit's or a local session (runner.spark_master)

    def arguments(self) -> dict:
        """What the output depends on (all but where it runs), recorded in it to refuse a resume with other ones."""
        return {k: v for k, v in asdict(self).items() if k not in ("processes", "spark")}

    @property
    def fingerprints(self) -> bool:
        return self.dedup or bool(self.dedup_against)


def check_rules(cfg: FilterConfig) -> None:
    """Every rule in range and at least one given; a UsageError in one line otherwise."""
    if bool(cfg.target) != (cfg.clusters is not None):
        raise UsageError("--target and --clusters go together: the image-based rule needs both")
    basic.check_thresholds(cfg)
    if cfg.keep_uids is not None:
        uids.check_uid_file(cfg.keep_uids)
    given = cfg.clip_score_min, cfg.keep_fraction, cfg.keep_uids
    others = cfg.fingerprints or (cfg.metadata, cfg.balance_t, cfg.semdedup_eps) != (None, None, None)
    if all(v is None for v in given) and not cfg.target and not others and not basic.thresholds(cfg):
        raise UsageError(
            "no rule given: pass --clip_score_min, --keep_fraction, --target (with --clusters), --dedup_against, "
            "--dedup, --basic_filter (or one of its parts), --keep_uids, --semdedup_eps or --metadata (with "
            "--balance_t)"
        )
    balance.check_balance(cfg.metadata, cfg.balance_t)
    semdedup.check_semdedup(cfg.semdedup_eps, cfg.semdedup_clusters, cfg.kmeans_sample)
    if cfg.clip_score_min is not None:
        scores.check_score_min(cfg.clip_score_min)
    if cfg.keep_fraction is not None:
        scores.check_fraction(cfg.keep_fraction)
    if cfg.clusters is not None:
        cl.check_clusters(cfg.clusters, cfg.kmeans_sample)
    if cfg.dedup_threshold is not None:
        if not cfg.fingerprints:
            raise UsageError("--dedup_threshold: give --dedup or --dedup_against, whose copies it defines")
        from disco_clip_ds.data.curate.copies import check_threshold

        check_threshold(cfg.dedup_threshold)
    if (cfg.samples_per_shard is not None and cfg.samples_per_shard < 1) or cfg.processes < 1:
        raise UsageError("--samples_per_shard and --processes: give positive numbers")


def run_filter(cfg: FilterConfig) -> dict:
    """Filter `cfg.shards` into `cfg.output`; returns the summary (also written as OUTPUT/summary.json)."""
    # 1. Check the inputs and claim the output folder
    check_rules(cfg)
    urls = inputs.local_shards(cfg.shards)
    sidecars, fingerprint = inputs.sidecars(urls, cfg.embeddings, cfg.teacher)
    for target in cfg.target:
        inputs.check_target_teacher(target, fingerprint)
    targets = _targets(cfg) if cfg.target else None  # before any scan: a target that cannot be embedded is refused
    for folder in cfg.dedup_against:
        inputs.check_reference(folder)
    matching = balance.listing(cfg.metadata) if cfg.metadata else None  # the list read and checked before any work
    if runner.spark_master(cfg.spark) is not False:
        runner.check_spark(runner.spark_master(cfg.spark))
    output = Path(cfg.output)
    with writer_lock(output, "--output", "disco-clip data filter"):  # one filter at a time writes an output folder
        inputs.claim_output(output, cfg.arguments())
        return _filter_into(output, cfg, urls, sidecars, fingerprint, targets, matching)


def _filter_into(output: Path, cfg: FilterConfig, urls, sidecars, fingerprint: str, targets, matching=None) -> dict:
    """Steps 2 to 5 of `run_filter`, into the claimed `output`."""
    state = output / STATE
    (state / "scan").mkdir(parents=True, exist_ok=True)
    scans = [state / "scan" / f"{i:05d}.npz" for i in range(len(urls))]
    with runner.open_runner(cfg.processes, runner.spark_master(cfg.spark)) as pool:
        # 2. Scan every input shard
        facts = basic.needs(basic.thresholds(cfg))
        tasks = [(u, s, p, cfg.fingerprints, facts, matching) for u, s, p in zip(urls, sidecars, scans)]
        list(_bar(pool.map(scan_shard, tasks), len(tasks), "scanning"))
        # 3. Decide
        loaded = _load_scans(scans, cfg.fingerprints)
        drops, assigned = decide(cfg, sidecars, loaded, targets, state, pool)
        _later_rules(cfg, sidecars, loaded, drops, matching)
        reason = first_rule(drops, len(loaded["scores"]))
        _refuse_repeated_keys(urls, scans, loaded, reason < 0)
        # 4. Write the output shards
        kept = np.flatnonzero(reason < 0)
        per_shard = reshard.shard_size(len(kept), cfg.samples_per_shard)
        plan = reshard.plan_shards(kept, loaded["offsets"], per_shard)
        writes = [
            (
                output / reshard.output_name(j),
                [(urls[i], sidecars[i], scans[i], rows) for i, rows in pieces],
                fingerprint,
            )
            for j, pieces in enumerate(plan)
        ]
        sizes = {}
        for j, (name, count) in enumerate(_bar(pool.map(write_shard, writes), len(writes), "writing")):
            sizes[name] = count
            faults.after_output_shard(j)
    for folder in (output, state / "scan"):  # the staged files of tasks that were killed and run again (Spark)
        remove_leftovers(folder)
    write_json(output / "sizes.json", sizes)
    # 5. The parquet of every input key and the summary
    _write_report(output / "filter.parquet", urls, scans, loaded, assigned, reason)
    uids.write_kept(output / uids.KEPT_UIDS, scans, reason < 0)
    summary = {**summarize(reason), "kept_by_rule": kept_by_rule(drops), "output_shards": len(plan)}
    summary["samples_per_shard"] = per_shard
    write_json(output / "summary.json", summary)
    return summary


def _bar(results, total: int, what: str):
    """A tqdm bar over the shards a step goes through, on stderr when it is a terminal (a log or a pipe keeps the
    filter's lines alone: a refusal stays one line)."""
    from tqdm.auto import tqdm

    # tqdm's default lock holds a multiprocessing lock: a POSIX semaphore in /dev/shm that a kill -9 leaves behind
    tqdm.set_lock(threading.RLock())
    return tqdm(results, total=total, desc=f"{what} shards", unit=" shards", dynamic_ncols=True, disable=None)


def decide(cfg, sidecars, loaded, targets, state, pool) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """{rule: mask of the samples it drops} and each sample's cluster (-1: not embedded; None without --target)."""
    embedded = loaded["embedded"]
    drops = {"no_embedding": ~embedded}
    if cfg.keep_uids is not None:
        drops["keep_uids"] = ~uids.kept_by_file(cfg.keep_uids, inputs.local_shards(cfg.shards), loaded["scans"])
    rules = basic.thresholds(cfg)
    drops.update(basic.drops(rules, basic.load_facts(loaded["scans"], rules)))
    values = loaded["scores"]
    if cfg.clip_score_min is not None:
        drops["clip_score_min"] = embedded & ~scores.above_min(values, cfg.clip_score_min)
    if cfg.keep_fraction is not None:
        keep = np.zeros(len(values), bool)
        keep[embedded] = scores.top_fraction(values[embedded], cfg.keep_fraction)  # over the embedded samples
        drops["keep_fraction"] = embedded & ~keep
    assigned = None
    if cfg.target:
        centres = _centres(cfg, sidecars, loaded, state)
        tasks = [(sidecar, scan, centres) for sidecar, scan in zip(sidecars, loaded["scans"])]
        assigned = np.concatenate(list(pool.map(assign_shard, tasks)))
        chosen = cl.target_clusters(centres, targets)
        drops["target"] = embedded & ~cl.in_clusters(assigned, chosen)
    if cfg.fingerprints:
        _dedup_rules(cfg, loaded, drops)
    return drops, assigned


def _dedup_rules(cfg: FilterConfig, loaded: dict, drops: dict) -> None:
    """The copy rules (copies.py): copies of a reference image, then copies of an earlier sample among those every
    other rule keeps (so a copy whose first was dropped for its score is kept in its place)."""
    from disco_clip_ds.data.curate import copies

    threshold = copies.DEFAULT_THRESHOLD if cfg.dedup_threshold is None else cfg.dedup_threshold
    embedded, hashes = loaded["embedded"], loaded["hashes"]
    if cfg.dedup_against:
        reference = copies.reference_fingerprints(list(cfg.dedup_against))
        # a sample without embeddings has no fingerprint (zeros): searched, but never counted, so no copy is made
        drops["dedup_against"] = embedded & copies.copies_of_reference(hashes, reference, threshold)
    if cfg.dedup:
        candidates = np.flatnonzero(~np.logical_or.reduce(list(drops.values())))
        copy = np.zeros(len(embedded), bool)
        copy[candidates] = copies.copies_within(loaded["digests"][candidates], hashes[candidates], threshold)
        drops["dedup"] = copy


def _later_rules(cfg: FilterConfig, sidecars: list[Path], loaded: dict, drops: dict, matching) -> None:
    """SemDeDup (semdedup.py), then MetaCLIP's balancing (balance.py), each among the samples every rule before it
    keeps: the balance counts entries over the pool that reaches it, as MetaCLIP balances a pool already cleaned."""
    if cfg.semdedup_eps is not None:
        pool = ~np.logical_or.reduce(list(drops.values()))
        rows = ((sidecar, _scan_rows(scan)) for sidecar, scan in zip(sidecars, loaded["scans"]))
        embeddings = semdedup.pool_embeddings(rows, pool)
        gone = semdedup.semdedup_drops(embeddings, cfg.semdedup_eps, cfg.semdedup_clusters, cfg.kmeans_sample, cfg.seed)
        drops["semdedup"] = np.zeros(len(pool), bool)
        drops["semdedup"][np.flatnonzero(pool)[gone]] = True
    if matching:
        pool = ~np.logical_or.reduce(list(drops.values()))
        args = (loaded["scans"], loaded["offsets"], pool, cfg.balance_t, cfg.seed, matching.size)
        drops["balance"] = balance.balance_drops(*args)


def _targets(cfg: FilterConfig) -> np.ndarray:
    """The target sets' embeddings (targets.py), stacked."""
    from disco_clip_ds.data.curate.targets import target_embeddings

    embedded = [target_embeddings(t, cfg.teacher, cfg.tokenizer_name) for t in cfg.target]
    return np.concatenate([np.asarray(e, np.float32) for e in embedded])


def _centres(cfg: FilterConfig, sidecars: list[Path], loaded: dict, state: Path) -> np.ndarray:
    """The k-means centres, trained once on the seeded sample of embedded samples and kept for a resume."""
    path = state / f"centres-{cfg.clusters}-{cfg.kmeans_sample}-{cfg.seed}.npy"
    if path.is_file():
        return np.load(path)
    # the sample is drawn among the embedded samples in input order; the k-th embedded sample of a shard is the one
    # of its k-th embedded key, so no array over every sample is made to find the sidecar rows
    per_shard = np.array([int(np.count_nonzero(_scan_rows(scan) >= 0)) for scan in loaded["scans"]])
    starts = np.cumsum(per_shard) - per_shard
    chosen = cl.sample_rows(int(per_shard.sum()), cfg.kmeans_sample, cfg.seed)
    owners = np.searchsorted(starts, chosen, side="right") - 1
    sample = []
    for shard in np.unique(owners):
        image = read_sidecar(sidecars[shard])[1].numpy()
        rows = _scan_rows(loaded["scans"][shard])
        sample.append(image[rows[rows >= 0][chosen[owners == shard] - starts[shard]]])
    centres = cl.train_centres(np.concatenate(sample), cfg.clusters, cfg.seed)
    _save_npy(path, centres)
    return centres


# --- the per-shard tasks (module level: a pool pickles them by name) ---


def scan_shard(task: tuple[str, Path, Path, bool, tuple, balance.Listing | None]) -> None:
    """Scan input shard `url` into `scan` (keys, scores, sidecar rows, fingerprints), unless a scan of the shard and
    sidecar as they are now is there already."""
    url, sidecar, scan, with_fingerprints, facts, matching = task
    stamp = [read_metadata(sidecar).get("sha256", ""), str(os.path.getsize(url))]
    stamp = np.array(stamp + ([matching.digest] if matching else []))  # a scan matched against another list is redone
    if _saved_stamp(scan) == stamp.tolist():
        with np.load(scan) as saved:
            if basic.scanned(saved, *facts):
                return
    rows_of, image, text, _ = read_sidecar(sidecar)
    embedded_scores = scores.clip_scores(image.numpy(), text.numpy())
    keys, rows, prints = [], [], []
    located = None if with_fingerprints else sample_members(url)  # where each sample lies, kept for the write
    samples = ({"__key__": key} for key in located.keys) if located else raw_samples(url, read=with_fingerprints)
    for sample in samples:
        keys.append(sample["__key__"])
        rows.append(rows_of.get(sample["__key__"], -1))
        if with_fingerprints:
            prints.append(_fingerprint(sample, url) if rows[-1] >= 0 else None)
    unmatched = set(rows_of) - set(keys)
    if unmatched:
        raise UsageError(
            f"{sidecar}: holds sample {sorted(unmatched)[0]}, which shard {url} does not: it does not match its shard; "
            f"run `disco-clip data embed` for {url} again"
        )
    rows = np.array(rows, np.int64)
    values = np.full(len(keys), np.nan, np.float32)
    values[rows >= 0] = embedded_scores[rows[rows >= 0]]
    arrays = {"keys": _key_blob(keys), "scores": values, "rows": rows.astype(np.int32), "stamp": stamp}
    if with_fingerprints:
        arrays.update(_stack_fingerprints(prints))
    arrays.update(basic.sample_facts(basic.shard_samples(url, located), *facts))  # uids, captions, sizes
    if located:
        arrays.update(located.arrays())
    if matching:  # the caption's metadata entries (balance.py)
        arrays.update(balance.shard_matches(url, located, keys, rows, balance.matcher(matching)))
    _save_npz(scan, arrays)


def _saved_stamp(scan: Path) -> list | None:
    """The stamp of the scan saved at `scan`; None when there is none, or none that reads (a torn or overwritten
    file): scanned again."""
    try:
        with np.load(scan) as saved:
            return saved["stamp"].tolist()
    except (OSError, ValueError, KeyError, EOFError, TypeError, zipfile.BadZipFile):
        return None


def assign_shard(task: tuple[Path, Path, np.ndarray]) -> np.ndarray:
    """Each sample's nearest centre (-1 for a sample without embeddings), in shard order."""
    sidecar, scan, centres = task
    rows = _scan_rows(scan)
    assigned = np.full(len(rows), -1, np.int32)
    image = read_sidecar(sidecar)[1].numpy()
    assigned[rows >= 0] = cl.nearest_centre(centres, image[rows[rows >= 0]])
    return assigned


def write_shard(task) -> tuple[str, int]:
    """Write output shard `path` from its pieces, unless it is complete and verifies; (its name, its samples)."""
    path, pieces, fingerprint = task
    keys, located = [], []
    for url, sidecar, scan, rows in pieces:
        with np.load(scan) as saved:
            names = _keys(saved)
            located.append((url, sidecar, rows, Members.from_arrays(names, saved)))
        keys += [names[i] for i in rows]
    if not reshard.is_complete(path, keys, fingerprint):
        reshard.write_output_shard(path, located)
    return path.name, len(keys)


def _refuse_repeated_keys(urls: list[str], scans: list[Path], loaded: dict, kept: np.ndarray) -> None:
    """A key kept from two samples (the same data under two names, `a::a_copy`; two downloads numbering their keys
    alike) is refused before any output shard is written, whatever --samples_per_shard, naming the key and both
    shards (copies of one image are dropped by --dedup first, so they pass)."""

    def kept_keys(i: int) -> list[str]:
        with np.load(scans[i]) as saved:
            keys = _keys(saved)
        start = loaded["offsets"][i]
        return [keys[j] for j in np.flatnonzero(kept[start : start + loaded["counts"][i]]).tolist()]

    repeated = reshard.first_repeated_key(urls, kept_keys)
    if repeated:
        key, first, second = repeated
        where = f"twice from {first}" if first == second else f"from both {first} and {second}"
        raise UsageError(
            f"--shards: sample key {key} is kept {where}: an output's keys must be unique (a shard's sidecar finds "
            "a sample by its key); filter those sources into separate --output folders (training reads them "
            "together, '::'-joined)"
        )


def _fingerprint(sample: dict, url: str):
    from disco_clip_ds.data.curate.copies import image_fingerprint

    image = next((sample[ext] for ext in IMAGE_EXTS if ext in sample), None)
    try:
        return image_fingerprint(image)
    except Exception as error:  # the teacher embedded it, so it decoded then: the shard changed since
        raise DataError(f"{url}: sample {sample['__key__']}: cannot fingerprint its image ({error})") from error


def _stack_fingerprints(prints: list) -> dict:
    """The scan's fingerprint arrays: digests (n, D) and hashes (n, ...) uint8, zero rows for samples without."""
    first = next((p for p in prints if p is not None), None)
    if first is None:
        return {"digests": np.zeros((len(prints), 0), np.uint8), "hashes": np.zeros((len(prints), 0), np.uint8)}
    digest0, hashes0 = first[0], np.asarray(first[1], np.uint8)
    digests = np.zeros((len(prints), len(digest0)), np.uint8)
    hashes = np.zeros((len(prints), *hashes0.shape), np.uint8)
    for i, p in enumerate(prints):
        if p is not None:
            digests[i] = np.frombuffer(p[0], np.uint8)
            hashes[i] = np.asarray(p[1], np.uint8)
    return {"digests": digests, "hashes": hashes}


def _load_scans(scans: list[Path], with_fingerprints: bool) -> dict:
    """The scans' scores (float32), embedded mask, sample counts, offsets (each shard's first global row) and
    fingerprints; keys and sidecar rows stay on disk until a step reads them a shard at a time."""
    values, embedded, digests, hashes = [], [], [], []
    for scan in scans:
        with np.load(scan) as saved:
            values.append(saved["scores"])
            embedded.append(saved["rows"] >= 0)
            if with_fingerprints:
                digests.append(saved["digests"])
                hashes.append(saved["hashes"])
    loaded = {
        "scans": scans,
        "scores": np.concatenate(values),
        "embedded": np.concatenate(embedded),
        "counts": [len(v) for v in values],
        "offsets": np.cumsum([0] + [len(v) for v in values])[:-1],
    }
    if with_fingerprints:
        loaded["digests"], loaded["hashes"] = _concat_ragged(digests), _concat_ragged(hashes)
    return loaded


def _concat_ragged(parts: list[np.ndarray]) -> np.ndarray:
    """Concatenate per-shard fingerprint arrays, a shard without any (all zero-width) widened to the others."""
    shape = next((p.shape[1:] for p in parts if p.size), parts[0].shape[1:])
    return np.concatenate([p if p.shape[1:] == shape else np.zeros((len(p), *shape), np.uint8) for p in parts])


def _write_report(path: Path, urls, scans, loaded, assigned, reason) -> None:
    writer = ReportWriter(path)
    for url, scan, start, count in zip(urls, scans, loaded["offsets"], loaded["counts"]):
        end = start + count
        with np.load(scan) as saved:
            keys = _keys(saved)
        clusters = None if assigned is None else assigned[start:end]
        writer.add(url, keys, loaded["scores"][start:end], clusters, reason[start:end])
    writer.close()


def _key_blob(keys: list[str]) -> np.ndarray:
    """The keys as one UTF-8 blob, NUL-separated (no tar member name holds a NUL): a byte a character, where numpy's
    str arrays take four."""
    return np.frombuffer("\0".join(keys).encode(), np.uint8)


def _keys(saved) -> list[str]:
    blob = saved["keys"].tobytes().decode()
    return blob.split("\0") if len(saved["scores"]) else []


def _scan_rows(scan: Path) -> np.ndarray:
    """A scan's sidecar row per sample (-1: not embedded), read when needed rather than held for every shard."""
    with np.load(scan) as saved:
        return saved["rows"]


def _save_npz(path: Path, arrays: dict) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_bytes(path, buffer.getvalue())


def _save_npy(path: Path, array: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.save(buffer, array)
    write_bytes(path, buffer.getvalue())
