"""Launched: 2 ranks train from a save_to_disk dataset (torchrun) and a streamed parquet folder (accelerate), resume
from a mid-run checkpoint to the uninterrupted run's losses and weights, and 1 rank x K=2 accumulates like 2 ranks x
K=1; a resume with another dataset is refused."""

import json
import shutil
from pathlib import Path

import pytest

from disco_clip_ds.testing.launch import LAUNCH_COMMON

from unit.data.hfsets import hf_dataset, hf_rows

STEPS, PER_RANK = 6, 3  # 20 rows, 2 bad: 9 good per reader and pass, 18 trained per reader: passes wrap


BAD_ROWS = {3: "corrupt", 12: "empty"}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The data, the initial weights, and the runs: uninterrupted and resumed from a copy of its checkpoint-3, for a
    map-style source under torchrun and a streaming one under accelerate; and 1 rank x 2 workers accumulating K=2
    over the map-style source under the deepspeed launcher."""
    from disco_clip_ds.testing.launch import REPO, SGD, run_to_end
    from disco_clip_ds.testing.runs import save_initial_model

    root = tmp_path_factory.mktemp("hflaunch")
    ds = hf_dataset(hf_rows(20, BAD_ROWS))
    ds.save_to_disk(str(root / "saved"))
    (root / "parquet").mkdir()
    for k, part in enumerate(((0, 7), (7, 14), (14, 20))):  # 3 files, 2 readers: datasets steps through all rows
        ds.select(range(*part)).to_parquet(str(root / "parquet" / f"part-{k}.parquet"))
    model = save_initial_model(root / "tiny", 13)
    sources = {
        "map": ["--dataset_name", str(root / "saved")],
        "stream": ["--dataset_name", str(root / "parquet"), "--streaming", "true", "--train_num_samples", "20"],
    }
    launchers = {"map": "torchrun", "stream": "accelerate"}
    common = [*LAUNCH_COMMON, *SGD, "--model_name_or_path", str(model), "--max_steps", str(STEPS)]
    common += ["--per_device_train_batch_size", str(PER_RANK), "--save_steps", "3", "--shuffle_buffer", "4"]
    zero2 = ["--deepspeed", str(REPO / "ds_configs/cpu_zero2.json")]  # under accelerate its ZeRO-2 yaml names it
    for kind, source in sources.items():
        full, resumed = root / f"{kind}_full", root / f"{kind}_resumed"
        source = [*source, *(zero2 if launchers[kind] != "accelerate" else [])]
        rc, log = run_to_end(full, ["--output_dir", str(full), *common, *source], launcher=launchers[kind])
        assert rc == 0, log[-3000:]
        resumed.mkdir()
        shutil.copy(full / "run.json", resumed / "run.json")
        shutil.copytree(full / "checkpoint-3", resumed / "checkpoint-3")
        args = ["--output_dir", str(resumed), *common, *source, "--resume_from_checkpoint", "latest"]
        rc, log = run_to_end(resumed, args, launcher=launchers[kind])
        assert rc == 0, log[-3000:]
        assert "resume: the data stream seeks to where 2 readers stood" in log
    k2 = [*common, *zero2, *sources["map"], "--dataloader_num_workers", "2", "--gradient_accumulation_steps", "2"]
    rc, log = run_to_end(root / "n1_k2", ["--output_dir", str(root / "n1_k2"), *k2], launcher="deepspeed", nproc=1)
    assert rc == 0, log[-3000:]
    return root


def _results(run: Path) -> dict:
    return json.loads((run / "train_results.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["map", "stream"])
def test_two_ranks_train_and_a_resumed_run_ends_with_the_uninterrupted_losses_and_weights(launched, kind):
    from disco_clip_ds.testing.runs import same_weights, step_losses, weights

    full, resumed = launched / f"{kind}_full", launched / f"{kind}_resumed"
    assert same_weights(full, resumed) == 0.0
    assert step_losses(resumed) == step_losses(full)  # its log holds the checkpoint's steps, then its own
    w0 = weights(launched / "tiny")
    assert max((weights(full)[k] - w0[k]).abs().max().item() for k in w0) > 1e-3  # it trained
    # each pass holds the 2 bad rows; the full run read a second pass of both readers
    assert _results(full)["skipped_samples"] >= 2 * 2 and _results(full)["decoded_samples"] >= STEPS * 2 * PER_RANK
    assert _results(resumed)["decoded_samples"] < _results(full)["decoded_samples"]  # it sought, not re-read
    state = json.loads((full / "checkpoint-3" / "stream_state.json").read_text())
    assert state["source"] == "datasets" and sorted(state["readers"]) == ["0", "1"]
    assert all(entry["count"] == 3 * PER_RANK for entry in state["readers"].values())
    if kind == "stream":  # 9 good rows per reader (and a bad one) in blocks of 4: in block 2, at datasets' state_dict
        assert all(e["block"] == 2 and e["offset"] >= 1 for e in state["readers"].values())
        assert all(e["state_dict"]["examples_iterable"] for e in state["readers"].values())
    run = json.loads((full / "run.json").read_text())
    assert run["data"].startswith("datasets ") and "num_shards" not in run


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_rank_accumulating_two_micro_batches_trains_like_two_ranks(launched):
    """1 rank x 2 DataLoader workers, K=2: its micro-batches come from readers 0 and 1, the two ranks' readers of
    map_full, and the contrastive loss over both equals the 2-rank one."""
    from disco_clip_ds.testing.runs import assert_same_training, weights

    assert_same_training(launched / "n1_k2", launched / "map_full", weights(launched / "tiny"), steps=STEPS)


@pytest.mark.slow
def test_a_resume_with_another_dataset_is_refused_in_one_line(launched, tmp_path, capsys):
    from disco_clip_ds.commands.train import main
    from disco_clip_ds.errors import run_main
    from disco_clip_ds.testing.launch import REPO, SGD

    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(launched / "map_full" / "run.json", out / "run.json")
    shutil.copytree(launched / "map_full" / "checkpoint-3", out / "checkpoint-3")
    argv = ["--output_dir", str(out), "--model_name_or_path", str(launched / "tiny"), *LAUNCH_COMMON, *SGD]
    # one rank reading for two (2 workers, a batch of 2 x 3): only the data differs from the run's
    argv += ["--max_steps", str(STEPS), "--per_device_train_batch_size", str(2 * PER_RANK), "--save_steps", "3"]
    argv += ["--deepspeed", str(REPO / "ds_configs/cpu_zero2.json"), "--dataloader_num_workers", "2"]
    argv += ["--dataset_name", str(launched / "saved"), "--caption_column", "id", "--resume_from_checkpoint", "latest"]
    assert run_main(main, argv, "disco-clip train") == 2  # first: the column is refused as it is
    capsys.readouterr()
    argv[-4:-2] = ["--image_column", "image"]
    argv += ["--train_split", "train", "--dataset_name", str(launched / "parquet"), "--train_num_samples", "20"]
    assert run_main(main, argv, "disco-clip train") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("disco-clip train: ")]
    assert len(err) == 1 and "cannot resume checkpoint-3 under changed settings: training data datasets " in err[0]
    # run.json records the source as the model card shows it (data/redact.py): a local path by its last component
    assert "datasets saved split train" in err[0] and "-> datasets parquet split" in err[0]
    assert "pass the run's --dataset_name/--train_file, split and columns, or --ignore_data_skip" in err[0]
