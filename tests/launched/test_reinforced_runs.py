"""Exactness by construction: training from a reinforced set (`data embed --augmentations 2 --teacher T1 T2
--caption_keys txt,syn0.txt`, then `--teacher_embeddings --augmentation_pool --synthetic_caption_ratio`) ends at the
weights of the same run whose two teachers run live on the same replayed crops and captions (`--live_teacher`),
within 1e-4: CLIP and SigLIP students, on 1 rank x K = 2 micro-batches and on 2 ranks. (The choices and the stream:
tests/unit/data/test_reinforced.py; the refusals: tests/unit/train/test_validate_reinforced.py.)"""

import pytest

from disco_clip_ds.testing.images import add_synthetic_captions, write_shards
from disco_clip_ds.testing.launch import QUICK, REPO, SGD, TINY_CONFIG, TOKENIZER_DIR, launch, launch_in_one_process
from disco_clip_ds.testing.runs import same_weights, save_initial_model, step_losses, weights

STEPS = 2
SIGLIP_TINY = REPO / "recipes/models/siglip_tiny.json"
# dispatch_batches: every launch reads one stream, whatever its ranks, so that the runs see the same 64 samples
SAME_STREAM = ["--max_steps", str(STEPS), "--accelerator_config", '{"dispatch_batches": true}']


def save_teachers(root, config, seeds=(21, 22)) -> list[str]:
    """Two tiny teachers of the student's shapes (so that they see the student's pixels and tokens as `data embed`
    made them), drawn with other seeds."""
    return [str(save_initial_model(root / f"teacher{seed}", seed, config)) for seed in seeds]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from disco_clip_ds.commands.data import embed_main

    root = tmp_path_factory.mktemp("reinforced")
    urls = write_shards(root / "data", num_shards=2, per_shard=32, seed=3)
    for url in urls:
        add_synthetic_captions(url)
    plan, torchrun = [], []
    for family, config in (("clip", TINY_CONFIG), ("siglip", SIGLIP_TINY)):
        teachers = save_teachers(root / family, config)
        embedded = root / family / "embeddings"
        argv = ["--teacher", *teachers, "--shards", str(root / "data"), "--output", str(embedded)]
        argv += ["--augmentations", "2", "--caption_keys", "txt,syn0.txt", "--tokenizer_name", str(TOKENIZER_DIR)]
        assert embed_main(argv) == 0
        common = [
            "--model_name_or_path",
            str(save_initial_model(root / family / "init", 11, config)),
            "--train_shards",
            f"{root}/data/{{00000..00001}}.tar",
            "--train_num_samples",
            "64",
            *SGD,
            *SAME_STREAM,
            "--teacher",
            *teachers,
            "--teacher_embeddings",
            str(embedded),
            "--augmentation_pool",
            "--synthetic_caption_ratio",
            "0.5",
            "--distill_weight",
            "0.7",
        ]
        k2 = ["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "2"]
        plan += [
            (root / f"{family}_live_k2", [*common, *k2, "--live_teacher"]),
            (root / f"{family}_stored_k2", [*common, *k2]),
        ]
        torchrun.append((root / f"{family}_stored_n2", [*common, "--per_device_train_batch_size", "16"]))
    launch_in_one_process(plan)
    for output, args in torchrun:  # the same 32 pairs a step, as 2 ranks x 16 (every launch reads one stream)
        launch(QUICK, 2, output, *args)
    return root


@pytest.mark.timeout(900)
@pytest.mark.slow
@pytest.mark.parametrize("family", ["clip", "siglip"])
@pytest.mark.parametrize("layout", ["k2", "n2"])
def test_a_stored_reinforced_run_ends_where_the_live_ensemble_does(runs, family, layout):
    """Stored, on 1 rank x K = 2 micro-batches and on 2 ranks, against the live ensemble on 1 rank x K = 2 (the
    runs of one family read the same stream, so all train on the same pairs, crops and captions)."""
    stored, live = runs / f"{family}_stored_{layout}", runs / f"{family}_live_k2"
    assert len(step_losses(stored)) == STEPS
    assert step_losses(stored) == pytest.approx(step_losses(live), rel=1e-4)
    assert same_weights(stored, live) <= 1e-4
    # not the agreement of runs that hardly moved: each moved its weights far beyond the tolerance
    initial = weights(runs / family / "init")
    assert max((v - initial[k]).abs().max().item() for k, v in weights(stored).items()) > 1e-2
    assert "distilling from" in (runs / f"{stored.name}.log").read_text()
