"""Resume seeks to the stream position: each reader restarts at its saved (pass, shard, sample, block offset) and
decodes only what it still has to yield.

Fast tests check the stream itself against references that do not share its logic: webdataset's own tar reader
for the raw samples of a shard, and an uninterrupted stream (or DataLoader) for what a restored one yields next,
with bad samples, a missing shard, blocks that cross shards and passes that wrap. The launched tests (slow) stop
2-rank runs early and late and check that the resumed runs decode no more than they train on and end with the
uninterrupted run's weights.
"""

import json
import shutil
from itertools import islice
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from disco_clip_ds.data.collate import POSITION_KEY, ClipCollator
from disco_clip_ds.data.streams.shards import ShardStream
from disco_clip_ds.data.streams.state import (
    POSITION_FIELDS,
    as_rows,
    note_positions,
    positions_to_restore,
    read_stream_state,
    write_stream_state,
)
from disco_clip_ds.data.streams.tar_samples import raw_samples
from disco_clip_ds.errors import UsageError
from disco_clip_ds.testing.images import write_shards
from disco_clip_ds.testing.launch import TOKENIZER_DIR

BAD = {1: "corrupt", 7: "no_text", 12: "empty_text", 13: "gray", 20: "corrupt"}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """6 shards x 5 samples with bad ones, plus a shard that is missing: blocks of 4 cross shard boundaries."""
    root = tmp_path_factory.mktemp("stream")
    return write_shards(root, num_shards=6, per_shard=5, seed=2, bad=BAD) + [str(root / "missing.tar")]


def _identity(item) -> tuple:
    """A sample's caption and colour: write_shards draws flat images of random colours, which no crop changes."""
    pixels, caption, position = item
    return caption, tuple(round(float(c), 3) for c in pixels.double().mean(dim=(1, 2)))


def test_raw_samples_from_any_start_match_webdataset(shards):
    from webdataset.tariterators import tarfile_samples

    for url in shards[:3]:
        reference = [{k: v for k, v in s.items() if k != "__local_path__"} for s in tarfile_samples([{"url": url}])]
        assert len(reference) == 5
        for start in range(len(reference) + 1):
            assert list(raw_samples(url, start)) == reference[start:], (url, start)


@pytest.mark.parametrize("block", [1, 4, 9])
def test_a_restored_stream_yields_what_the_uninterrupted_one_does_next(shards, block):
    # reader 0 of 2 (rank 0): 3 shards (3 bad samples) + the missing one, 12 good samples per pass; 40 = 3+ passes
    reference = list(islice(ShardStream(shards, 16, rank=0, world_size=2, seed=5, shuffle_buffer=block), 40))
    keys = [_identity(item) for item in reference]
    assert len(set(keys[:12])) == 12 and set(keys[12:24]) == set(keys[:12])  # each pass: every good sample once
    assert keys[:12] != keys[12:24] or block == 1  # a new order each pass (shards reordered, blocks reshuffled)
    for n in (1, 2, 3, 5, 11, 12, 13, 17, 30):
        position = reference[n - 1][2].tolist()
        assert position[0] == 0 and position[1] == n  # the reader, the samples it has yielded
        stream = ShardStream(shards, 16, rank=0, world_size=2, seed=5, shuffle_buffer=block)
        stream.restore({0: position[1:]}, consumed_batches=0)
        resumed = list(islice(stream, 10))
        assert [_identity(item) for item in resumed] == keys[n : n + 10], n
        assert [item[2].tolist() for item in resumed] == [item[2].tolist() for item in reference[n : n + 10]]
        assert stream.decoded.value == 10  # only what it yielded: nothing before the position is decoded


def test_a_restored_dataloader_with_workers_continues_the_uninterrupted_batches(shards):
    """Two workers per rank hand out batches in turn; after c batches the next comes from worker c mod 2, so the
    fresh loader's worker 0 takes that worker's place. Positions are folded as the trainer folds them."""
    collate = ClipCollator(AutoTokenizer.from_pretrained(TOKENIZER_DIR), 8)

    def loader(stream):
        return torch.utils.data.DataLoader(stream, batch_size=3, num_workers=2, collate_fn=collate)

    def batches(stream, n):
        out = []
        for batch in loader(stream):
            out.append(batch)
            if len(out) == n:
                return out

    def make():
        return ShardStream(shards, 16, rank=0, world_size=2, seed=1, shuffle_buffer=4, num_workers=2)

    reference = batches(make(), 12)
    for consumed in (1, 2, 5):
        newest: dict = {}
        for batch in reference[:consumed]:
            note_positions(newest, batch[POSITION_KEY])
        assert sorted(newest) == [0, 1][: min(consumed, 2)]  # readers 0 and 1 of 4: rank 0's two workers
        stream = make()
        stream.restore({reader: row[1:] for reader, row in newest.items()}, consumed)
        resumed = batches(stream, 4)
        for got, want in zip(resumed, reference[consumed : consumed + 4]):
            assert torch.equal(got["pixel_values"], want["pixel_values"]), consumed
            assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(
                got[POSITION_KEY], want[POSITION_KEY]
            )


def test_positions_are_folded_per_reader_saved_and_checked(tmp_path):
    newest: dict = {}
    note_positions(newest, torch.tensor([[2, 5, 0, 1, 0, 3], [2, 6, 0, 1, 0, 4]]))
    note_positions(newest, torch.tensor([[0, 9, 1, 0, 4, 1], [2, 4, 0, 0, 4, 2]]))  # an older row of reader 2
    assert newest == {0: [0, 9, 1, 0, 4, 1], 2: [2, 6, 0, 1, 0, 4]}
    rows = torch.cat([as_rows(newest, 3), as_rows({2: [2, 7, 0, 1, 0, 5]}, 3)])  # as gathered from two ranks
    assert rows.shape == (6, len(POSITION_FIELDS)) and (rows[:, 0] == -1).sum() == 3
    facts = {"num_readers": 4, "seed": 3, "shuffle_buffer": 8}
    write_stream_state(tmp_path, rows, facts, POSITION_FIELDS)
    state = read_stream_state(tmp_path)
    named = lambda row: dict(zip(POSITION_FIELDS[1:], row))  # noqa: E731
    assert state["readers"] == {"0": named([9, 1, 0, 4, 1]), "2": named([7, 0, 1, 0, 5])}
    assert positions_to_restore(state, facts, POSITION_FIELDS, tmp_path) == {0: (9, 1, 0, 4, 1), 2: (7, 0, 1, 0, 5)}
    with pytest.raises(UsageError, match="saved reading the data differently .num_readers 4 -> 2.*--ignore_data_skip"):
        positions_to_restore(state, {**facts, "num_readers": 2}, POSITION_FIELDS, tmp_path)
    assert read_stream_state(tmp_path / "none") is None and read_stream_state(None) is None


# --- launched runs: 2 ranks x 2 DataLoader workers, 3 micro-batches per step (contrastive accumulation) ---

STEPS, PER_RANK, ACCUM, WORKERS = 6, 4, 3, 2
PER_STEP = 2 * PER_RANK * ACCUM  # samples trained on per step, both ranks
# What a rank's readers decode beyond what it trains on: each worker's prefetched batches (2) and the one in the
# making, per reader. It does not depend on the step a run resumes at.
AHEAD = 2 * WORKERS * (2 + 1) * PER_RANK
PIXEL_CAP = 300 * 300  # the data holds one 400 x 400 image: skipped under this cap


def _launch_args(output: Path, data: dict, *args: str) -> list[str]:
    from disco_clip_ds.testing.launch import LAUNCH_COMMON, REPO, SGD

    from helpers import run_and_data

    return [
        *run_and_data(output, data),
        *LAUNCH_COMMON,
        "--dataloader_num_workers",
        str(WORKERS),
        "--per_device_train_batch_size",
        str(PER_RANK),
        "--gradient_accumulation_steps",
        str(ACCUM),
        "--max_steps",
        str(STEPS),
        "--save_steps",
        "1",
        "--save_total_limit",
        str(STEPS),
        "--max_image_pixels",
        str(PIXEL_CAP),
        *SGD,
        "--deepspeed",
        str(REPO / "ds_configs/cpu_zero2.json"),
        *args,
    ]


def _decoded(output: Path) -> int:
    return json.loads((output / "train_results.json").read_text())["decoded_samples"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """8 shards x 10 samples (10 per reader and pass: every reader wraps into new passes), a few bad samples and one
    image above PIXEL_CAP."""
    from helpers import save_initial_model

    root = tmp_path_factory.mktemp("seekdata")
    write_shards(root / "shards", 8, 10, seed=4, bad={3: "corrupt", 25: "no_text", 41: "large", 62: "empty_text"})
    return {"shards": str(root / "shards"), "model": save_initial_model(root / "tiny", 11)}


@pytest.fixture(scope="module")
def full(tmp_path_factory, data):
    """The uninterrupted run, a checkpoint at every step."""
    from helpers import run_to_end

    out = tmp_path_factory.mktemp("full") / "run"
    rc, log = run_to_end(out, _launch_args(out, data), launcher="torchrun")
    assert rc == 0, log[-3000:]
    return out


def _resume_from_copy(full: Path, step: int, out: Path, data: dict, drop_state: bool = False) -> tuple[int, str]:
    """Resume in OUT from a copy of the full run's checkpoint-STEP (and its run.json)."""
    from helpers import run_to_end

    out.mkdir(parents=True)
    shutil.copy(full / "run.json", out / "run.json")
    shutil.copytree(full / f"checkpoint-{step}", out / f"checkpoint-{step}")
    if drop_state:  # a checkpoint as older versions saved it: no stream state, no manifest
        (out / f"checkpoint-{step}" / "stream_state.json").unlink()
        (out / f"checkpoint-{step}" / "manifest.json").unlink()
    return run_to_end(out, _launch_args(out, data, "--resume_from_checkpoint", "latest"), launcher="torchrun")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_seeks_decodes_what_it_trains_on_and_ends_with_the_uninterrupted_weights(full, data, tmp_path):
    from helpers import same_weights

    state = json.loads((full / "checkpoint-5" / "stream_state.json").read_text())
    assert state["num_readers"] == 2 * WORKERS and sorted(state["readers"]) == ["0", "1", "2", "3"]
    assert _decoded(full) >= STEPS * PER_STEP
    decoded = {}
    for step in (1, 5):  # early and late; 1 x 3 and 5 x 3 micro-batches: the next batch is from worker 1 of 2
        out = tmp_path / f"from{step}"
        rc, log = _resume_from_copy(full, step, out, data)
        assert rc == 0, log[-3000:]
        assert "resume: the data stream seeks to where 4 readers stood" in log
        assert same_weights(out, full) <= 1e-6, step
        decoded[step] = _decoded(out)
        trained = (STEPS - step) * PER_STEP
        assert trained <= decoded[step] <= trained + AHEAD, (step, decoded[step])
    assert decoded[5] < decoded[1]  # decoding on resume falls with the steps done, where skipping decoded them all


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_checkpoint_without_stream_state_resumes_by_skipping(full, data, tmp_path):
    from helpers import same_weights

    out = tmp_path / "old"
    rc, log = _resume_from_copy(full, 4, out, data, drop_state=True)
    assert rc == 0, log[-3000:]
    assert "has no stream_state.json (saved by an older version): fast-forwarding the data stream" in log
    assert same_weights(out, full) <= 1e-6
    assert _decoded(out) >= STEPS * PER_STEP  # every sample since step 0 decoded again
    assert (out / "checkpoint-5" / "stream_state.json").is_file()  # every reader handed out a batch since: known


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_normalising_on_the_device_trains_bit_identically(full, data, tmp_path):
    """--normalize_on_device true on CPU ranks: the workers hand over uint8 batches and the trainer normalises
    them (here on the CPU, as it would on a GPU) for both passes of contrastive accumulation: the same losses and
    exactly the weights of the default run, whose workers normalise."""
    from helpers import run_to_end, step_losses, weights

    out = tmp_path / "on_device"
    rc, log = run_to_end(out, _launch_args(out, data, "--normalize_on_device", "true"), launcher="torchrun")
    assert rc == 0, log[-3000:]
    assert "the DataLoader hands over uint8 batches, normalised on cpu" in log
    assert "hands over uint8" not in (full.parent / "run.log").read_text()
    assert step_losses(out) == step_losses(full)
    on_device, default = weights(out), weights(full)
    assert on_device.keys() == default.keys() and all(torch.equal(on_device[k], default[k]) for k in default)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_under_dispatch_batches_seeks_rank_0s_readers(data, tmp_path):
    """accelerate's dispatch_batches: rank 0 reads for both ranks with 3 workers, handing out 2 batches per step;
    after 2 steps its next batch comes from worker 4 mod 3 = 1. The resumed run's checkpoint-3 follows one step
    (2 batches) in which reader 0 handed out nothing: its restored position must be saved again, which a second
    resume from it shows; that one hands over uint8 batches (--normalize_on_device true), which accelerate
    broadcasts as they are."""
    from helpers import run_to_end, same_weights

    dispatch = ["--accelerator_config", '{"dispatch_batches": true}', "--dataloader_num_workers", "3"]
    dispatch += ["--gradient_accumulation_steps", "1", "--max_steps", "4"]
    full = tmp_path / "full"
    rc, log = run_to_end(full, _launch_args(full, data, *dispatch), launcher="torchrun")
    assert rc == 0, log[-3000:]
    on_device = ["--normalize_on_device", "true"]
    for source, step, out, extra in (
        (full, 2, tmp_path / "resumed", []),
        (tmp_path / "resumed", 3, tmp_path / "again", on_device),
    ):
        out.mkdir()
        shutil.copy(full / "run.json", out / "run.json")
        shutil.copytree(source / f"checkpoint-{step}", out / f"checkpoint-{step}")
        rc, log = run_to_end(
            out, _launch_args(out, data, *dispatch, *extra, "--resume_from_checkpoint", "latest"), launcher="torchrun"
        )
        assert rc == 0, log[-3000:]
        assert "resume: the data stream seeks to where 3 readers stood" in log
        assert same_weights(out, full) <= 1e-6, out.name
        trained = (4 - step) * 2 * PER_RANK
        assert _decoded(out) <= trained + 3 * (2 + 1) * 2 * PER_RANK  # what it trained on, and what is ahead


@pytest.mark.slow
def test_max_image_pixels_skips_and_counts_a_larger_image(full):
    log = (full.parent / "run.log").read_text()
    assert "400 x 400 pixels, above 90000" in log
    skipped = json.loads((full / "train_results.json").read_text())["skipped_samples"]
    assert skipped >= 4  # the large image, the corrupt one, the ones without or with an empty caption


# --- a reader without samples ---


def _empty_second_shard(folder: Path, sizes: bool) -> str:
    """Two shards, the second a valid tar without members; sizes.json (when asked for) records 5 and 0 samples."""
    import tarfile

    urls = write_shards(folder, num_shards=1, per_shard=5)
    tarfile.open(folder / "00001.tar", "w").close()
    if sizes:
        (folder / "sizes.json").write_text(json.dumps({"00000.tar": 5, "00001.tar": 0}))
    else:
        (folder / "sizes.json").unlink()
    return urls[0].replace("00000.tar", "{00000..00001}.tar")


def test_a_reader_with_only_empty_shards_is_refused_before_the_model_is_built(tmp_path, capsys):
    from disco_clip_ds.errors import run_main
    from disco_clip_ds.testing.launch import LAUNCH_COMMON, TINY_CONFIG
    from disco_clip_ds.train.run import main

    shards = _empty_second_shard(tmp_path / "shards", sizes=True)
    argv = ["--output_dir", str(tmp_path / "run"), "--model_config", str(TINY_CONFIG), "--train_shards", shards]
    argv += [*LAUNCH_COMMON, "--max_steps", "1", "--dataloader_num_workers", "2"]  # 1 rank x 2 workers: 2 readers
    assert run_main(main, argv, "disco-clip train") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "disco-clip train: reader 1 of 2 (rank 0, DataLoader worker 1) would read only shards without samples ("
        f"{tmp_path / 'shards' / '00001.tar'}: 0 samples in their sizes.json"
    ), err
    assert "leave empty shards out of --train_shards, or use fewer ranks x --dataloader_num_workers" in err[0]
    assert not (tmp_path / "run").exists()
    assert run_main(main, [*argv[:-2], "--dataloader_num_workers", "1", "--max_image_pixels", "0"], "t") == 2
    assert "--max_image_pixels 0: give a positive number" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_whose_shards_hold_no_sample_stops_every_rank_with_one_line(data, tmp_path):
    """Counts unknown (no sizes.json): rank 1's reader finds nothing once training runs; both ranks end, each with
    the same one line, exit 1, no traceback (deepspeed launcher: it passes the ranks' exit code on)."""
    from disco_clip_ds.testing.launch import LAUNCH_COMMON

    from helpers import run_to_end

    shards = _empty_second_shard(tmp_path / "shards", sizes=False)
    out = tmp_path / "run"
    args = ["--output_dir", str(out), "--model_name_or_path", str(data["model"]), "--train_shards", shards]
    args += [*LAUNCH_COMMON, "--max_steps", "2", "--train_num_samples", "5"]
    rc, log = run_to_end(out, args, launcher="deepspeed", timeout=300)
    lines = [line for line in log.splitlines() if line.startswith("disco-clip train: ")]
    assert rc == 1 and len(lines) == 2, log[-3000:]
    assert lines[0] == lines[1] and lines[0].startswith(
        "disco-clip train: reader 1 of 2 (rank 1, DataLoader worker 0) found no readable sample in its shard(s) "
        f"{tmp_path / 'shards' / '00001.tar'}: check that they exist and hold samples"
    ), lines
    assert "Traceback" not in log
