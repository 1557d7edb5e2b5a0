"""eval/spread.py: the evaluation's batches dealt out across ranks and gathered back in order; `disco-clip eval
--tasks` on 2 spawned gloo ranks equals 1 rank, number for number, with each rank doing about half the work; a
batch that fails to decode on one rank stops its task on both, without a hang."""

from __future__ import annotations

import json

import numpy as np
import pytest

from disco_clip_ds.errors import DataError
from disco_clip_ds.eval.probe import choose_weight_decay, weight_decay_grid, weight_decay_sweep
from disco_clip_ds.eval.spread import across_ranks, interleaved, spread
from disco_clip_ds.testing.images import noise_image_bytes, write_samples

from unit.eval.sets import eval_main, tiny_clip


def test_interleaved_puts_each_ranks_items_back_in_order():
    # 3 ranks over 7 items: rank 0 holds 0, 3, 6; rank 1 holds 1, 4; rank 2 holds 2, 5
    assert interleaved([["a", "d", "g"], ["b", "e"], ["c", "f"]], 7) == list("abcdefg")


def test_in_one_process_spread_is_a_map_and_raises_what_prepare_raises():
    assert spread(range(5), lambda x: x * 10, lambda x: x + 1) == [1, 11, 21, 31, 41]
    assert spread([], str, str) == []
    assert across_ranks(lambda x: -x, [3, 1, 2]) == [-3, -1, -2]

    def prepare(x):
        if x == 2:
            raise DataError("item 2 is damaged")
        return x

    forwards = []
    with pytest.raises(DataError, match="item 2 is damaged"):
        spread(range(5), prepare, forwards.append)
    assert forwards == [0, 1]  # alone, nothing waits for it: it stops at once


def test_weight_decay_search_scores_each_steps_new_candidates_together():
    """`score_all` gets the 7 coarse grid points, then at each refinement step only the candidates not tried yet;
    the choice is the one made one candidate at a time."""
    grid, first = weight_decay_grid()
    peak = grid[40]  # a score that peaks at grid index 40, between two coarse points (32 and 48)

    def score(wd):
        return 1.0 - abs(np.log10(wd) - np.log10(peak)) / 10

    asked = []

    def score_all(fn, values):
        asked.append(list(values))
        return [fn(v) for v in values]

    assert choose_weight_decay(score, score_all=score_all) == choose_weight_decay(score) == peak
    assert asked[0] == [grid[i] for i in first]
    # coarse peak 32 or 48 (tied at 8 steps: the first, 32); then 24/40, 36/44, 38/42, 39/41 around the peak
    assert asked[1:] == [[grid[24], grid[40]], [grid[36], grid[44]], [grid[38], grid[42]], [grid[39], grid[41]]]


def test_ranks_left_idle_by_a_step_train_the_next_steps_candidates_and_the_choice_stays():
    """With `slots` ranks, the first grid points go in whole rounds, and a round with fewer new candidates trains
    ahead those the next steps ask for if the peak so far stands, then the final fit of that peak: the choice is the
    one-at-a-time choice for a score peaked anywhere on the grid (ties and the edges included); a peak at the grid's
    edge (one new candidate a step) takes 4 rounds of one training each after the first 3, the final fit in the last."""
    grid, first = weight_decay_grid()
    for top in range(len(grid)):
        for shape in (lambda i: 1 / (1 + abs(i - top)), lambda i: 1.0 if abs(i - top) <= 2 else 0.5):
            score = {wd: shape(i) for i, wd in enumerate(grid)}.__getitem__
            assert choose_weight_decay(score, slots=2) == choose_weight_decay(score, slots=3)
            assert choose_weight_decay(score, slots=2) == choose_weight_decay(score)
            found = weight_decay_sweep(score, slots=2, final=lambda wd: ("final", wd))
            assert found.weight_decay == choose_weight_decay(score)
            assert all(result == ("final", wd) for wd, result in found.finals.items())
    asked = []

    def score_all(fn, values):
        asked.append([grid.index(v) if isinstance(v, float) else ("final", grid.index(v.weight_decay)) for v in values])
        return [fn(v) for v in values]

    found = weight_decay_sweep(lambda wd: 1 / (1 + grid.index(wd)), score_all=score_all, slots=2, final=str)
    assert found.weight_decay == grid[0] and found.finals == {grid[0]: str(grid[0])}
    assert asked == [list(first[:6]), [96, 8], [4, 2], [1, ("final", 0)]]


TASKS = """
digits: {path: cls}
captions: {type: retrieval, path: ret}
probe: {type: linear_probe, path: probe, val_proportion: 0.25}
"""
DAMAGED = "damaged: {path: damaged}\ndigits: {path: cls}\n"


@pytest.fixture(scope="module")
def suite_sets(cls_set, tmp_path_factory):
    """Three tasks whose sets end in a partial batch at batch size 4 (11 images; 7 images with 1-3 captions; a probe
    of 16 train and 11 test images), and a set whose 6th image (in batch 1: rank 1's of 2) is not an image."""
    root = tmp_path_factory.mktemp("spread")
    folder, images, labels = cls_set
    samples = [{"jpg": b, "cls": str(y)} for b, y in zip(images, labels)]
    write_samples(root / "cls", samples, per_shard=5)
    for name in ("classnames.txt", "zeroshot_classification_templates.txt"):
        for kind in ("cls", "damaged"):
            (root / kind).mkdir(exist_ok=True)
            (root / kind / name).write_text((folder / name).read_text())
    rng = np.random.default_rng(4)
    captions = [[f"picture {i}", f"{i} things", "a picture"][: 1 + i % 3] for i in range(7)]
    ret = [{"png": noise_image_bytes(rng), "txt": "\n".join(c)} for c in captions]
    write_samples(root / "ret", ret, per_shard=3)
    write_samples(root / "probe" / "train", samples[:8] + samples[3:11], per_shard=8)
    write_samples(root / "probe" / "test", samples, per_shard=8)
    damaged = [dict(s) for s in samples[:8]]
    damaged[5]["jpg"] = b"not an image at all" * 10
    write_samples(root / "damaged", damaged, per_shard=8)
    (root / "tasks.yml").write_text(TASKS)
    (root / "damaged.yml").write_text(DAMAGED)
    return root


def _suite_on_ranks(rank: int, world_size: int, root: str, model_dir: str) -> dict:
    """`disco-clip eval --tasks` on this rank (the process group is up: the command joins it), counting the images and
    texts this rank's towers encoded and the probe trainings it ran; then the damaged list through `run_suite`."""
    from transformers import CLIPModel

    from disco_clip_ds.data.streams.tar_samples import Member
    from disco_clip_ds.eval import probe
    from disco_clip_ds.eval.suite import load_tasks, run_suite

    seen = {"images": 0, "texts": 0, "trainings": 0, "image_reads": 0}
    image_features, text_features, train, read = (
        CLIPModel.get_image_features,
        CLIPModel.get_text_features,
        probe._Trainer.train,
        Member.read,
    )

    def image_read(self):
        seen["image_reads"] += 1
        return read(self)

    from disco_clip_ds.eval import sources

    shards_read, raw_samples = [], sources.raw_samples

    def shard_read(url, *args, **kwargs):
        shards_read.append(url)
        return raw_samples(url, *args, **kwargs)

    sources.raw_samples = shard_read

    def images(self, pixel_values=None, **kwargs):
        seen["images"] += len(pixel_values)
        return image_features(self, pixel_values=pixel_values, **kwargs)

    def texts(self, input_ids=None, **kwargs):
        seen["texts"] += len(input_ids)
        return text_features(self, input_ids=input_ids, **kwargs)

    def training(self, *args, **kwargs):
        seen["trainings"] += 1
        return train(self, *args, **kwargs)

    CLIPModel.get_image_features, CLIPModel.get_text_features, probe._Trainer.train = images, texts, training
    Member.read = image_read
    out = f"{root}/out_{world_size}"
    code = eval_main(["--model", model_dir, "--tasks", f"{root}/tasks.yml", "--output", out, "--batch_size", "4"])
    counts = dict(seen, shards_read=sorted(shards_read))
    model, tokenizer, processor = tiny_clip()
    damaged = run_suite(load_tasks(f"{root}/damaged.yml"), model, tokenizer, processor, batch_size=4, progress=False)
    return {"code": code, "counts": counts, "damaged": [(r.task.key, r.value, str(r.error or "")) for r in damaged]}


def _metrics(folder) -> tuple[list, list]:
    table = json.loads((folder / "suite.json").read_text())
    return [(row["task"], row["value"]) for row in table["rows"]], table["records"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ranks_give_one_ranks_suite_each_doing_half_the_work(suite_sets, model_dir):
    from disco_clip_ds.testing.ranks import run_ranks

    (one,) = run_ranks(_suite_on_ranks, 1, str(suite_sets), str(model_dir), timeout=300)
    two = run_ranks(_suite_on_ranks, 2, str(suite_sets), str(model_dir), timeout=300)
    assert [r["code"] for r in (one, *two)] == [0, 0, 0]
    rows, records = _metrics(suite_sets / "out_1")
    assert _metrics(suite_sets / "out_2") == (rows, records)  # every metric, in full, and the probe's weight decay
    assert all(isinstance(value, float) and 0 <= value <= 1 for _, value in rows)
    # 1 rank encodes 45 images (11 + 7 + 16 + 11 at batch size 4). Of 2 ranks, rank 0 takes batches 0, 2, ... of
    # each set, rank 1 batches 1, 3, ..., and where a set ends in a round of one batch rank 1 encodes that batch too
    # and drops it: 7 + 4 + 8 + 7 images against 7 + 3 + 8 + 7
    assert one["counts"]["images"] == 45
    assert [r["counts"]["images"] for r in two] == [26, 25]
    # each rank reads the bytes of the images it encodes alone
    assert one["counts"]["image_reads"] == 45 and [r["counts"]["image_reads"] for r in two] == [26, 25]
    # and each shard's headers once, on one rank: the checks deal the shards out, and every rank evaluates from what
    # the checks read
    shards = one["counts"]["shards_read"]
    assert len(shards) == len(set(shards)) >= 4
    first, second = (r["counts"]["shards_read"] for r in two)
    assert sorted(first + second) == sorted(shards) and first and second
    # texts: 18 prompts (6 classes x 3 templates: one batch of 64, each rank encodes it) and 13 captions (batches of
    # 4, 4, 4, 1: 8 on rank 0, 5 on rank 1)
    assert one["counts"]["texts"] == 31 and [r["counts"]["texts"] for r in two] == [26, 23]
    # the sweep's trainings dealt in turn, a rank a round leaves idle training a later step's candidate or the final
    # fit ahead, else the final fit on each rank after the sweep: each rank trains about half
    trainings, sweep = [r["counts"]["trainings"] for r in two], one["counts"]["trainings"] - 1
    assert sweep >= 7 and sweep + 1 <= sum(trainings) <= sweep + 4 and max(trainings) <= (sweep + 1) // 2 + 2
    # the image of batch 1 that rank 1 decodes is damaged: skipped and counted (data/decode.py), the task's figure
    # the same on both ranks and as on one rank, the next task runs
    assert two[0]["damaged"] == two[1]["damaged"]
    (damaged, damaged_value, error), (digits, value, no_error) = two[0]["damaged"]
    assert error == "" and damaged_value is not None and value is not None and no_error == ""
    assert [(key, value) for key, value, _ in one["damaged"]] == [(key, value) for key, value, _ in two[0]["damaged"]]
