"""`disco-clip data download|verify|embed|filter|metadata|demo`: parse the arguments, call data/prep/, say what it did.

Also `python -m disco_clip_ds.commands.data demo --output DIR` (img2dataset's spawned workers re-import the main
module: this one imports the demo's library only when a command runs).
"""

from __future__ import annotations

import argparse
import ast
import sys
import time
from pathlib import Path

from disco_clip_ds.cli import ArgumentParser, DefaultsOnce
from disco_clip_ds.errors import DataError, UsageError, run_main


def download_parser() -> argparse.ArgumentParser:
    """`disco-clip data download`'s arguments (the rest pass through to img2dataset.download)."""
    from disco_clip_ds.data.prep.download import PRESETS
    from disco_clip_ds.data.prep.fetch import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS

    p = ArgumentParser(
        formatter_class=DefaultsOnce,
        prog="disco-clip data download",
        description="Download a dataset to webdataset shards with img2dataset. Any other img2dataset.download "
        "argument passes through (e.g. --encode_quality 90 --retries 1). Re-run the same command to resume.",
    )
    p.add_argument("--preset", choices=sorted(PRESETS), required=True, help="column names and image defaults")
    p.add_argument("--url_list", required=True, help="metadata file or folder (parquet/tsv/...)")
    p.add_argument("--output", required=True, help="output folder for NNNNN.tar shards")
    p.add_argument("--input_format", help="default: the preset's input format")
    p.add_argument("--url_col", help="default: the preset's URL column")
    p.add_argument("--caption_col", help="default: the preset's caption column")
    p.add_argument(
        "--save_additional_columns", type=ast.literal_eval, help="python list of columns to keep; default: preset's"
    )
    p.add_argument("--image_size", type=int, help="default: the preset's (256; datacomp 512)")
    p.add_argument(
        "--resize_mode",
        choices=["no", "border", "keep_ratio", "keep_ratio_largest", "center_crop"],
        help="img2dataset's resize (default: the preset's: border; datacomp keep_ratio_largest)",
    )
    p.add_argument("--processes", type=int, default=1, help="download processes")
    p.add_argument("--threads", type=int, default=64, help="download threads per process")
    p.add_argument("--samples_per_shard", type=int, default=10000)
    p.add_argument(
        "--distributor",
        choices=["multiprocessing", "pyspark"],
        default="multiprocessing",
        help="pyspark: one Spark task per shard; without --spark_master a local[--processes] session (needs Java 17+)",
    )
    p.add_argument(
        "--spark_master",
        help="Spark master URL (spark://HOST:7077, local[N], ...); default: the active session, spark-submit's, "
        "or local[--processes]",
    )
    p.add_argument("--timeout", type=float, default=10, help="seconds per socket operation")
    p.add_argument(
        "--max_download_seconds", type=float, default=60, help="wall-clock limit per image, trickling servers included"
    )
    p.add_argument(
        "--max_image_bytes",
        type=int,
        default=MAX_IMAGE_BYTES,
        help="bytes per image body: a larger one (or an endless one) fails as its own reason, unread",
    )
    p.add_argument(
        "--max_image_pixels",
        type=int,
        default=MAX_IMAGE_PIXELS,
        help="pixels per image by its header (training's cap): a larger one fails as its own reason, undecoded",
    )
    return p


def download_main(argv: list[str] | None = None) -> int:
    """`disco-clip data download`: see `download_parser`. A DataError when nothing arrived or a shard failed."""
    from disco_clip_ds.data.prep.download import DownloadConfig, download, parse_passthrough
    from disco_clip_ds.data.prep.outputs import print_summary

    args, rest = download_parser().parse_known_args(argv)
    cfg = DownloadConfig(**vars(args), extra=parse_passthrough(rest))
    summary = download(cfg)
    print_summary(summary, Path(cfg.output))
    if summary["successes"] == 0:
        raise DataError("no sample was downloaded; see failures_by_reason in summary.json")
    if summary["shards_failed"]:
        aside = summary["shards_set_aside"]
        moved = f" ({', '.join(aside)} cut short: set aside as .tar.partial)" if aside else ""
        raise DataError(f"{len(summary['shards_failed'])} shard(s) failed{moved}; re-run to retry")
    return 0


def verify_parser() -> argparse.ArgumentParser:
    """`disco-clip data verify`'s arguments."""
    p = ArgumentParser(
        formatter_class=DefaultsOnce,
        prog="disco-clip data verify",
        description="check webdataset shards, write sizes.json",
    )
    p.add_argument("folder", type=Path)
    p.add_argument("--decode", type=int, default=16, help="images to decode per shard")
    return p


def verify_main(argv: list[str] | None = None) -> int:
    """`disco-clip data verify DIR`: a DataError when a shard is broken."""
    from disco_clip_ds.data.prep.verify import verify

    args = verify_parser().parse_args(argv)
    if not args.folder.is_dir():
        raise UsageError(f"{args.folder} is not a folder")
    report = verify(args.folder, args.decode)
    words = report["caption_words"]
    print(
        f"{args.folder}: {report['shards']} shards, {report['samples']} samples in good shards, "
        f"{report['decoded']} images decoded; caption words {words}"
    )
    for name, errors in report["broken"].items():
        print(f"  BROKEN {name}: " + "; ".join(errors[:3]), file=sys.stderr)
    if report["broken"]:
        raise DataError(f"{len(report['broken'])} broken shard(s) in {args.folder}: re-create or remove them")
    return 0


def embed_parser() -> argparse.ArgumentParser:
    """`disco-clip data embed`'s arguments."""
    p = ArgumentParser(
        formatter_class=DefaultsOnce,
        prog="disco-clip data embed",
        description="Write the image and text embeddings of every sample of webdataset shards, by one teacher or an "
        "ensemble, for K augmentations of each image and each caption, into a sidecar per shard "
        "(NAME.DIGEST.teacher.safetensors, DIGEST from the shard's absolute path; keyed by sample key, checksummed), "
        "for `disco-clip train --teacher MODEL --teacher_embeddings DIR`. Re-run the same command to resume (a "
        "sidecar made with other settings is embedded again). Under torchrun (one rank per GPU; gloo ranks on CPU) "
        "rank r embeds shards r, r + N, ...",
    )
    p.add_argument(
        "--teacher", required=True, nargs="+", help="CLIPModel or SiglipModel folder or hub id; several: an ensemble"
    )
    p.add_argument("--shards", required=True, help="local shards: 'dir/{00000..00099}.tar', a folder, or '::'-joined")
    p.add_argument("--output", help="folder of the sidecars (default: beside each shard)")
    p.add_argument("--batch_size", type=int, default=64, help="samples per teacher forward")
    p.add_argument(
        "--tokenizer_name",
        nargs="+",
        help="the tokenizer of a teacher whose folder has none: one for every teacher, or one per teacher in "
        "--teacher's order (default: each teacher's own)",
    )
    p.add_argument(
        "--augmentations",
        type=int,
        default=0,
        help="K random resized crops per image, drawn as training draws them from (--seed, key, a), their boxes "
        "stored; 0: the centre crop alone",
    )
    p.add_argument("--seed", type=int, default=0, help="the seed of the augmentations' draw")
    p.add_argument(
        "--caption_keys",
        default="txt",
        help="comma-separated caption members to embed: txt (the caption training reads: txt, text or caption), "
        "syn0.txt (the member KEY.syn0.txt), ...; a sample lacking one is skipped and counted",
    )
    p.add_argument("--embedding_dtype", default="float32", help="stored dtype: float16, bfloat16 or float32")
    p.add_argument(
        "--num_workers",
        type=int,
        help="DataLoader workers per rank reading and decoding the shards while the teachers run (0: in the "
        "embedding process; the sidecars are the same whatever the number; default: the CPUs the rank may use, up "
        "to 4)",
    )
    p.add_argument(
        "--precision",
        default="auto",
        help="the teachers' forward: auto (bfloat16 autocast on a GPU, float32 on the CPU), float32, bfloat16 or "
        "float16 (autocast: GPU only); the embeddings are stored at --embedding_dtype either way",
    )
    return p


def embed_main(argv: list[str] | None = None) -> int:
    """`disco-clip data embed --teacher MODEL [MODEL ...] --shards SPEC`: see `embed_parser`."""
    from disco_clip_ds.checkpoint.layout import verify_model_folder
    from disco_clip_ds.data.prep.embed import Settings, embed_launched
    from disco_clip_ds.data.shards import local_shards
    from disco_clip_ds.models.source import check_model_source

    args = embed_parser().parse_args(argv)
    if args.batch_size < 1:
        raise UsageError(f"--batch_size {args.batch_size}: give a positive number of samples")
    settings = Settings(
        args.teacher,
        args.tokenizer_name,
        args.augmentations,
        args.caption_keys.split(","),
        args.embedding_dtype,
        args.seed,
    )
    for flag, sources in (("--teacher", settings.teachers), ("--tokenizer_name", args.tokenizer_name or [])):
        for source in sources:  # a mistyped folder at once, by its full path; a hub id while the hub is unreachable
            check_model_source(source, flag)
    for teacher in settings.teachers:  # a teacher's weights verified as `disco-clip export` verifies a model
        verify_model_folder(teacher, "--teacher")
    urls = local_shards(args.shards, "data embed")
    if args.output:
        Path(args.output).mkdir(parents=True, exist_ok=True)
    summary, rank = embed_launched(
        settings.teachers,
        urls,
        args.output,
        args.batch_size,
        settings=settings,
        num_workers=args.num_workers,
        precision=args.precision,
    )
    if rank == 0:
        lacking = ", ".join(f"{n} without {key}" for key, n in sorted(summary["missing_captions"].items()))
        empty = f" ({summary['empty']} empty: no sample)" if summary["empty"] else ""
        print(
            f"{len(summary['embedded'])} shard(s) embedded{empty}, {len(summary['kept'])} already done, "
            f"{summary['skipped']} sample(s) without image or caption skipped" + (f" ({lacking})" if lacking else "")
        )
        print(f"sidecars in {args.output}" if args.output else "sidecars beside their shards")
    return 0


def filter_parser() -> argparse.ArgumentParser:
    """`disco-clip data filter`'s arguments."""
    from disco_clip_ds.data.curate.copies import DEFAULT_THRESHOLD
    from disco_clip_ds.data.curate.reshard import MAX_PER_SHARD, MIN_SHARDS

    p = ArgumentParser(
        formatter_class=DefaultsOnce,
        prog="disco-clip data filter",
        description="Curate webdataset shards by their `data embed` sidecars, as DataComp and LAION do: keep what "
        "every rule given keeps, write it as new shards (members copied byte for byte) with their sidecars and "
        "sizes.json, filter.parquet (every input key, its score and the rule that dropped it) and summary.json. "
        "Re-run the same command to resume.",
    )
    p.add_argument(
        "--shards",
        metavar="SPEC",
        required=True,
        help="local shards: 'dir/{00000..00099}.tar', a folder, or '::'-joined",
    )
    p.add_argument(
        "--embeddings", metavar="DIR", help="folder of the shards' sidecars (default: beside each shard, as data embed)"
    )
    p.add_argument("--output", metavar="DIR", required=True, help="folder of the new shards")
    p.add_argument(
        "--teacher",
        metavar="MODEL",
        help="check that the sidecars are this teacher's; needed to embed a class-name or eval-set target (default: "
        "none: the sidecars' teacher is taken as it is)",
    )
    p.add_argument(
        "--tokenizer_name",
        metavar="NAME",
        help="the teacher's tokenizer when its folder has none (a class-name target; default: the teacher's own)",
    )
    p.add_argument(
        "--clip_score_min",
        metavar="S",
        type=float,
        help="keep cosine(image, text) >= S (LAION: 0.28 with ViT-B/32; default: no threshold)",
    )
    p.add_argument(
        "--keep_fraction",
        metavar="F",
        type=float,
        help="keep the top F of all samples by CLIP score (DataComp: 0.3; default: all)",
    )
    p.add_argument(
        "--clusters",
        metavar="K",
        type=int,
        help="k-means clusters of the image embeddings, for --target (default: none)",
    )
    p.add_argument(
        "--kmeans_sample", metavar="N", type=int, default=1_000_000, help="embeddings the k-means is trained on"
    )
    p.add_argument(
        "--target",
        metavar="DIR_OR_FILE",
        action="append",
        default=[],
        help="keep samples whose cluster is the nearest of an embedding of this set: a shards folder with sidecars, "
        "a CLIP_benchmark-style folder, or a text file of class names (repeatable; default: none)",
    )
    p.add_argument(
        "--dedup_against",
        metavar="DIR",
        action="append",
        default=[],
        help="drop copies of the images of this eval set (repeatable; default: none); a warning names "
        "--dedup_threshold when more than 3 %% of the samples are dropped as copies",
    )
    p.add_argument("--dedup", action="store_true", help="drop exact and near copies within the shards, keep the first")
    p.add_argument(
        "--dedup_threshold",
        metavar="BITS",
        type=int,
        help=f"how near counts as a copy: the Hamming distance in bits between 64-bit perceptual hashes, 0 to 31 "
        f"(default: {DEFAULT_THRESHOLD}, measured on 256 px photographs; 2 suits small, simple images such as the "
        "demo's digits)",
    )
    p.add_argument(
        "--samples_per_shard",
        metavar="N",
        type=int,
        help=f"samples per output shard (default: the kept count / {MIN_SHARDS}, at most {MAX_PER_SHARD:,}: at least "
        f"{MIN_SHARDS} shards, a shard per reader of training on 8 GPUs x 2 DataLoader workers)",
    )
    p.add_argument(
        "--semdedup_eps",
        metavar="E",
        type=float,
        help="SemDeDup: drop a sample whose image embedding's cosine with one kept before it in its k-means cluster "
        "is above 1 - E (default: no SemDeDup)",
    )
    p.add_argument("--semdedup_clusters", metavar="K", type=int, default=100, help="SemDeDup's k-means clusters")
    p.add_argument(
        "--metadata",
        metavar="FILE",
        help="MetaCLIP's balancing: a text file of entries, one a line, matched in the captions "
        "(with --balance_t; default: no balancing)",
    )
    p.add_argument(
        "--balance_t",
        metavar="T",
        type=float,
        help="MetaCLIP's t: keep a sample of an entry matched n times with probability min(1, T / n) "
        "(no default: MetaCLIP used 20000 for 400M)",
    )
    p.add_argument("--processes", metavar="N", type=int, default=1, help="shards scanned and written in parallel")
    p.add_argument(
        "--spark",
        metavar="MASTER",
        nargs="?",
        const="",
        help="scan and write as Spark tasks: on MASTER (spark://HOST:7077, local[N], ...); without MASTER the active "
        "session's, spark-submit's or local[--processes]; under spark-submit the default (needs Java 17+)",
    )
    p.add_argument(
        "--seed", metavar="N", type=int, default=0, help="the k-means sample and initialisation, the balance draw"
    )
    _datacomp_arguments(p)
    return p


def _datacomp_arguments(p: argparse.ArgumentParser) -> None:
    """`data filter`'s DataComp rules: the basic filter's parts (data/curate/basic.py) and the uid lists."""
    from disco_clip_ds.data.curate.basic import DATACOMP, PREFILTER

    def flags(values: dict) -> str:
        return " ".join(f"--{flag} {value}" for flag, value in values.items())

    g = p.add_argument_group(
        "DataComp's basic filter",
        "--basic_filter turns on all five rules at DataComp's values; a flag alone turns on its own rule (over "
        f"--basic_filter's value). --target also applies DataComp's caption pre-filter ({flags(PREFILTER)}).",
    )
    g.add_argument("--basic_filter", action="store_true", help=f"DataComp's basic filter: {flags(DATACOMP)}")
    g.add_argument(
        "--caption_language",
        metavar="CODE",
        help="keep captions fastText's lid.176 labels CODE (DataComp: en); 'any': no language rule "
        "(default: no rule, en with --basic_filter)",
    )
    g.add_argument(
        "--caption_words_over",
        metavar="N",
        type=int,
        help="keep captions of more than N words (default: no rule; DataComp, with --basic_filter: 2)",
    )
    g.add_argument(
        "--caption_chars_over",
        metavar="N",
        type=int,
        help="keep captions of more than N characters (default: no rule; DataComp: 5)",
    )
    g.add_argument(
        "--min_image_side",
        metavar="PX",
        type=int,
        help="keep images whose smaller side (before img2dataset resized it) is at least PX "
        "(default: no rule; DataComp: 200)",
    )
    g.add_argument(
        "--max_aspect_ratio",
        metavar="R",
        type=float,
        help="keep images whose longer side is at most R times the shorter (default: no rule; DataComp: 3)",
    )
    p.add_argument(
        "--keep_uids",
        metavar="FILE.npy",
        help="keep only the samples whose .json uid is in this DataComp subset file (np.dtype('u8,u8')); every "
        "run writes its kept uids as OUTPUT/kept_uids.npy in that format (default: every sample)",
    )


def filter_main(argv: list[str] | None = None) -> int:
    """`disco-clip data filter --shards SPEC --output DIR RULES`: see `filter_parser`."""
    from disco_clip_ds.data.curate.copies import DEFAULT_THRESHOLD
    from disco_clip_ds.data.curate.pipeline import FilterConfig, run_filter
    from disco_clip_ds.data.curate.report import summary_line, warnings
    from disco_clip_ds.models.source import check_model_source

    args = filter_parser().parse_args(argv)
    for flag in ("--teacher", "--tokenizer_name"):
        if getattr(args, flag[2:]):
            check_model_source(getattr(args, flag[2:]), flag)
    summary = run_filter(FilterConfig(**vars(args)))
    print(f"{args.output}: {summary_line(summary)}")
    threshold = DEFAULT_THRESHOLD if args.dedup_threshold is None else args.dedup_threshold
    for line in warnings(summary, threshold, DEFAULT_THRESHOLD):
        print(f"warning: {line}", file=sys.stderr)
    return 0


def metadata_parser() -> argparse.ArgumentParser:
    """`disco-clip data metadata`'s arguments."""
    p = ArgumentParser(
        formatter_class=DefaultsOnce,
        prog="disco-clip data metadata",
        description="fetch parquet metadata from the HF hub",
    )
    p.add_argument("--dataset", required=True, help="HF dataset id, e.g. laion/relaion2B-en-research-safe")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--pattern", nargs="+", default=["*.parquet"], help="glob(s) of files to fetch")
    p.add_argument("--revision", help="the dataset's branch, tag or commit (default: its main branch)")
    return p


def metadata_main(argv: list[str] | None = None) -> int:
    """`disco-clip data metadata --dataset ID --output DIR [--pattern GLOB ...]`."""
    from disco_clip_ds.data.prep.inputs import input_columns, input_rows
    from disco_clip_ds.data.prep.metadata import fetch_metadata

    args = metadata_parser().parse_args(argv)
    started = time.monotonic()
    files = fetch_metadata(args.dataset, args.output, args.pattern, args.revision)
    rows = sum(input_rows(f, "parquet") for f in files)
    print(f"{args.output}: {len(files)} parquet files, {rows} rows ({time.monotonic() - started:.1f}s)")
    print(f"columns of {files[0].name}: {input_columns(files[0], 'parquet')}")
    return 0


def demo_parser() -> argparse.ArgumentParser:
    """`disco-clip data demo`'s arguments."""
    from disco_clip_ds.data.prep.demo import FORMAT_FILES

    p = ArgumentParser(
        formatter_class=DefaultsOnce, prog="disco-clip data demo", description="build the offline digits demo dataset"
    )
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--image_size", type=int, default=64)
    p.add_argument("--samples_per_shard", type=int, default=180, help="180 gives 8 train shards")
    p.add_argument("--eval_fraction", type=float, default=0.2)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--caption_noise",
        type=float,
        default=0.0,
        help="the fraction of training samples captioned as another digit (noisy web captions; the eval split stays "
        "true): the distillation demo's data",
    )
    p.add_argument(
        "--format",
        choices=sorted(FORMAT_FILES),
        default="shards",
        help="shards: webdataset tar shards (downloaded through img2dataset); hf: the same samples as a datasets "
        "parquet dataset with an Image column (--processes and --threads unused)",
    )
    return p


def demo_main(argv: list[str] | None = None) -> int:
    """`disco-clip data demo --output DIR`."""
    from disco_clip_ds.data.prep.demo import build_demo, build_hf_demo, check_output_folder

    args = demo_parser().parse_args(argv)
    if not 0 < args.eval_fraction < 1:
        raise UsageError("--eval_fraction must be between 0 and 1")
    if not 0 <= args.caption_noise < 1:
        raise UsageError(
            f"--caption_noise {args.caption_noise:g}: give a fraction of the captions, at least 0 and below 1"
        )
    check_output_folder(args.output, args.format)
    started = time.monotonic()
    if args.format == "hf":
        train, evl = build_hf_demo(
            args.output, args.image_size, args.samples_per_shard, args.eval_fraction, args.seed, args.caption_noise
        )
        print(
            f"demo dataset (datasets parquet) in {args.output} ({time.monotonic() - started:.1f}s): train "
            f"{sum(train)} rows in {len(train)} files, eval {sum(evl)} rows in {len(evl)} files; "
            f"datasets.load_dataset('{args.output / 'train'}') reads it" + _planted(args.caption_noise, sum(train))
        )
        return 0
    summary, eval_sizes = build_demo(
        args.output,
        args.image_size,
        args.samples_per_shard,
        args.eval_fraction,
        args.processes,
        args.threads,
        args.seed,
        args.caption_noise,
    )
    print(
        f"demo dataset in {args.output} ({time.monotonic() - started:.1f}s): train {summary['successes']} samples "
        f"in {summary['shards_done']} shards, eval {sum(eval_sizes.values())} samples in {len(eval_sizes)} shards"
        + _planted(args.caption_noise, summary["successes"])
    )
    return 0


def _planted(caption_noise: float, train_samples: int) -> str:
    """What the demo's summary says of --caption_noise: how many training captions name another digit."""
    from disco_clip_ds.data.prep.demo import noisy_count

    if not caption_noise:
        return ""
    return f"; {noisy_count(caption_noise, train_samples)} training captions name another digit (--caption_noise)"


MAINS = {
    "download": download_main,
    "verify": verify_main,
    "metadata": metadata_main,
    "demo": demo_main,
    "filter": filter_main,
}

if __name__ == "__main__":  # img2dataset spawns workers that re-import the main module
    if len(sys.argv) < 2 or sys.argv[1] not in MAINS:
        sys.exit(f"usage: python -m disco_clip_ds.commands.data {{{','.join(MAINS)}}} ARGS")
    sys.exit(run_main(MAINS[sys.argv[1]], sys.argv[2:], f"disco-clip data {sys.argv[1]}"))
