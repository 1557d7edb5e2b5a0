"""transformers' zero-shot-image-classification pipeline against `disco-clip eval` on one classification set.

`disco-clip eval` averages the text embeddings of every prompt template (`zeroshot_classification_templates.txt`
beside the shards: the demo has 5), as CLIP_benchmark does; the pipeline scores one prompt, its
`hypothesis_template` ("This is a photo of {}." unless given). For each template of the set, this script runs eval
with that template alone (`--templates FILE` of one line) and the pipeline with `hypothesis_template` the same
sentence, on every image of the set, and records both accuracies: equal when the two read the images and tokenize the
prompts alike. It also records eval's number with all the templates (the ensemble) and the pipeline's with its
default prompt.

    python bench/eval/pipeline_vs_eval.py --model outputs/quickstart --data data/demo/eval
    # writes bench/eval/results/pipeline_vs_eval.csv
"""

from __future__ import annotations

import argparse
import io
import tarfile
import tempfile
from pathlib import Path

from PIL import Image

from disco_clip_ds.testing.bench_record import write_rows

RESULTS = Path(__file__).parent / "results" / "pipeline_vs_eval.csv"
PIPELINE_DEFAULT = "This is a photo of {}."  # transformers' hypothesis_template default


def eval_acc1(model: str, data: str, templates: list[str] | None) -> float:
    """`disco-clip eval --model MODEL --data DATA [--templates FILE]`'s acc1 (all the set's templates when None)."""
    from disco_clip_ds.commands.eval import EvalArguments, run_eval

    with tempfile.TemporaryDirectory() as tmp:
        file = None
        if templates is not None:
            file = Path(tmp) / "templates.txt"
            file.write_text("\n".join(templates) + "\n")
        record = run_eval(EvalArguments(model=model, data=data, templates=str(file) if file else None))
    return record["metrics"]["acc1"]


def labelled_images(data: str) -> list[tuple[Image.Image, int]]:
    """Every (image, label) of the set's shards, read with tarfile and PIL."""
    samples: dict[str, dict] = {}
    for shard in sorted(Path(data).glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, _, ext = member.name.partition(".")
                samples.setdefault(f"{shard.name}/{key}", {})[ext] = tar.extractfile(member).read()
    images = [ext for ext in ("jpg", "png", "webp")]
    return [
        (Image.open(io.BytesIO(next(s[e] for e in images if e in s))).convert("RGB"), int(s["cls"]))
        for s in samples.values()
    ]


def pipeline_acc1(classifier, samples, classnames: list[str], template: str) -> float:
    """The share of images whose top label, by the pipeline with `hypothesis_template`, is their class."""
    images = [image for image, _ in samples]
    outputs = classifier(images, candidate_labels=classnames, hypothesis_template=template, batch_size=64)
    hits = sum(out[0]["label"] == classnames[label] for out, (_, label) in zip(outputs, samples))
    return hits / len(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="an exported or final model folder")
    parser.add_argument("--data", required=True, help="a classification set in CLIP_benchmark's wds layout")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    from transformers import pipeline

    folder = Path(args.data)
    classnames = (folder / "classnames.txt").read_text().splitlines()
    templates = (folder / "zeroshot_classification_templates.txt").read_text().splitlines()
    classifier = pipeline("zero-shot-image-classification", model=args.model)
    samples = labelled_images(args.data)
    rows = [
        {
            "template": "all (eval's ensemble)",
            "eval_acc1": eval_acc1(args.model, args.data, None),
            "pipeline_acc1": "",
            "equal": "",
        }
    ]
    for template in [*templates, PIPELINE_DEFAULT.replace("{}", "{c}")]:
        ours = eval_acc1(args.model, args.data, [template])
        theirs = pipeline_acc1(classifier, samples, classnames, template.replace("{c}", "{}"))
        rows.append({"template": template, "eval_acc1": ours, "pipeline_acc1": theirs, "equal": ours == theirs})
        print(f"{template!r}: eval {ours:.4f}, pipeline {theirs:.4f}")
    print(f"eval with all {len(templates)} templates: {rows[0]['eval_acc1']:.4f}")
    extra = {"model": args.model, "data": args.data, "images": len(samples)}
    print(write_rows(args.output, [{**extra, **row} for row in rows], rounds=1))


if __name__ == "__main__":
    main()
