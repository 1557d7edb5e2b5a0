"""Training from a reinforced set (data/streams/reinforced.py): the augmentation and caption each sample is trained on
are functions of (seed, pass, key) alone, uniform over the K stored augmentations and drawn at the synthetic caption
ratio; the stream crops from the chosen stored box and carries that augmentation's and caption's stored targets; a
sample without its chosen caption is skipped and counted."""

import random
import tarfile
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import binomtest, chisquare

from disco_clip_ds.data.streams.reinforced import (
    REAL_CAPTION,
    Reinforcement,
    augmentation_index,
    caption_choice,
    stack_targets,
)
from disco_clip_ds.testing.images import add_synthetic_captions, write_shards

KEYS = [f"{i:09d}" for i in range(4000)]


@pytest.mark.slow  # beyond the fast tier's time budget
def test_the_augmentation_is_uniform_over_the_pool_and_a_function_of_seed_pass_and_key():
    for k in (2, 5):
        counts = [0] * k
        for key in KEYS:
            counts[augmentation_index(0, 0, key, k)] += 1
        assert chisquare(counts).pvalue > 1e-3, counts  # uniform (a fixed draw: the p-value is a constant)
    # the same inputs give the same index, in any process (string seeds hash by sha512, not by PYTHONHASHSEED)
    assert [augmentation_index(3, 1, key, 8) for key in KEYS[:50]] == [
        random.Random(f"3/augmentation/1/{key}").randrange(8) for key in KEYS[:50]
    ]
    # another pass, another seed: other augmentations (about 7/8 of the keys change at K = 8)
    for other in ((3, 2), (4, 1)):
        changed = sum(augmentation_index(3, 1, k, 8) != augmentation_index(*other, k, 8) for k in KEYS)
        assert binomtest(changed, len(KEYS), 7 / 8).pvalue > 1e-3


@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.5, 1.0])
def test_a_synthetic_caption_is_drawn_at_the_ratio_and_uniformly_among_the_synthetic_ones(ratio):
    synthetic = ("syn0.txt", "syn1.txt", "syn2.txt")
    chosen = [caption_choice(7, 0, key, ratio, synthetic) for key in KEYS]
    drawn = sum(c != REAL_CAPTION for c in chosen)
    if ratio in (0.0, 1.0):
        assert drawn == ratio * len(KEYS)
    else:
        assert binomtest(drawn, len(KEYS), ratio).pvalue > 1e-3, drawn
        assert chisquare([chosen.count(s) for s in synthetic]).pvalue > 1e-3
    assert all(caption_choice(7, 0, key, 0.9, ()) == REAL_CAPTION for key in KEYS[:100])  # none stored: the real one
    assert chosen == [caption_choice(7, 0, key, ratio, synthetic) for key in KEYS]


def _sample(tar_path: str, key: str) -> dict:
    """The members of sample `key` of a tar, by extension (webdataset's rule: split at the first dot)."""
    with tarfile.open(tar_path) as tar:
        return {
            m.name.split(".", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers() if m.name.startswith(key + ".")
        }


class FakeStore:
    """An EmbeddingStore's lookup: per sample, K boxes and per teacher (K, d) images and {caption key: (d,)} texts,
    made from the key so that a test can say which row was read."""

    def __init__(self, k: int, teachers: int = 2, missing: str | None = None):
        self.k, self.teachers, self.missing = k, teachers, missing

    def lookup(self, shard: str, key: str):
        n = int(key)
        boxes = torch.tensor([[a, a, 30 + a, 30 + a] for a in range(self.k)])
        images = [torch.tensor([[n, t, a] for a in range(self.k)], dtype=torch.float32) for t in range(self.teachers)]
        texts = [
            {c: torch.tensor([n, t, 100 + i]) for i, c in enumerate(("txt", "syn0.txt")) if (key, c) != self.missing}
            for t in range(self.teachers)
        ]
        return SimpleNamespace(images=images, texts=texts, boxes=boxes)

    def check_order(self, shard: str, keys: list[str], after: int = -1) -> int:
        return after


@pytest.mark.slow  # beyond the fast tier's time budget
def test_the_stream_crops_from_the_chosen_stored_box_and_carries_its_targets(tmp_path):
    from disco_clip_ds.data.streams.shards import ShardStream
    from disco_clip_ds.data.transforms import ImageTransform

    urls = write_shards(tmp_path / "data", num_shards=2, per_shard=12, seed=2)
    without = "000000003"  # a sample whose synthetic caption is missing: skipped and counted when it is drawn
    for url in urls:
        add_synthetic_captions(url, {without})
    pool = Reinforcement(FakeStore(3), 3, pool=True, ratio=0.5, synthetic=("syn0.txt",))
    stream = ShardStream(urls, 16, seed=5, shuffle_buffer=4, reinforcement=pool)
    items = [item for _, item in zip(range(60), stream)]
    transform = ImageTransform(16)
    seen = set()
    for pixels, caption, targets, position in items:
        epoch = int(position[3])
        key = f"{int(targets[0][0][0]):09d}"  # the fake store's rows name their sample
        index, chosen = pool.choose(5, epoch, key)
        sample = _sample(next(u for u in urls if u.endswith(f"{key[:5]}.tar")), key)
        assert caption == sample[chosen].decode().strip()
        box = (index, index, 30 + index, 30 + index)
        assert torch.equal(pixels, transform.from_bytes(sample["jpg"], None, box=box))
        for t, (image, text) in enumerate(targets):  # teacher t's embedding of that augmentation and that caption
            assert image.tolist() == [int(key), t, index]
            assert text.tolist() == [int(key), t, 100 + ("txt", "syn0.txt").index(chosen)]
        seen.add((key, chosen, index))
    assert {c for _, c, _ in seen} == {"txt", "syn0.txt"} and {i for *_, i in seen} == {0, 1, 2}
    drawn_without = [e for e in range(3) if pool.choose(5, e, without)[1] != REAL_CAPTION]
    assert stream.skipped.value == len(drawn_without) > 0  # counted once per pass it was drawn without its caption
    images, texts = stack_targets([item[2] for item in items[:4]])
    assert len(images) == 2 and images[1].shape == (4, 3) and texts[0].dtype == torch.float32


def test_a_stored_caption_missing_for_a_teacher_is_skipped_and_counted(tmp_path):
    from disco_clip_ds.data.streams.shards import ShardStream

    urls = write_shards(tmp_path / "data", num_shards=1, per_shard=6, seed=2)
    missing = ("000000002", "txt")
    stream = ShardStream(urls, 16, seed=1, reinforcement=Reinforcement(FakeStore(2, missing=missing), 2, pool=True))
    keys = [f"{int(item[2][0][0][0]):09d}" for _, item in zip(range(11), stream)]  # into the third pass
    assert missing[0] not in keys and len(set(keys)) == 5
    assert stream.skipped.value in (2, 3)  # once per pass read through (two whole, the third begun)


def test_without_targets_the_stream_replays_the_crops_and_captions_alone(tmp_path):
    """--live_teacher: the same crops and captions as the stored run, no targets (the teachers run on them)."""
    from disco_clip_ds.data.streams.shards import ShardStream

    urls = write_shards(tmp_path / "data", num_shards=1, per_shard=8, seed=2)
    options = dict(seed=4, shuffle_buffer=3)
    stored = ShardStream(urls, 16, reinforcement=Reinforcement(FakeStore(4), 4, pool=True), **options)
    live = ShardStream(urls, 16, reinforcement=Reinforcement(FakeStore(4), 4, pool=True, targets=False), **options)
    a = [item for _, item in zip(range(16), stored)]
    b = [item for _, item in zip(range(16), live)]
    assert all(len(x) == 4 and len(y) == 3 for x, y in zip(a, b))
    assert all(torch.equal(x[0], y[0]) and x[1] == y[1] and torch.equal(x[3], y[2]) for x, y in zip(a, b))


@pytest.mark.slow  # builds a tiny teacher and embeds 16 samples x 3 augmentations (~3 s)
def test_the_stored_targets_are_the_teachers_forward_of_the_replayed_crop_and_chosen_caption(tmp_path):
    """Sidecars made by `data embed --augmentations 3 --caption_keys txt,syn0.txt`, read by the pooled stream: the
    targets each sample carries are a fresh forward of the teacher on the pixels and caption the stream yields (the
    crop replayed from the stored box of the chosen augmentation, the chosen caption's member), to 1e-6."""
    from transformers import AutoTokenizer

    from disco_clip_ds.data.collate import ClipCollator
    from disco_clip_ds.data.embeddings import EmbeddingStore
    from disco_clip_ds.data.prep.embed import Settings, embed_shards
    from disco_clip_ds.data.streams.shards import ShardStream
    from disco_clip_ds.data.teacher_id import teacher_fingerprint
    from disco_clip_ds.testing.launch import TOKENIZER_DIR
    from disco_clip_ds.testing.runs import save_initial_model
    from disco_clip_ds.train.distill import load_teacher, split_inputs

    urls = write_shards(tmp_path / "data", num_shards=1, per_shard=16, seed=6)
    add_synthetic_captions(urls[0])
    teacher = str(save_initial_model(tmp_path / "teacher", 5))
    settings = Settings([teacher], [str(TOKENIZER_DIR)], augmentations=3, caption_keys=["txt", "syn0.txt"])
    embed_shards(teacher, urls, str(tmp_path / "emb"), settings=settings)
    store = EmbeddingStore(tmp_path / "emb", teacher_fingerprint(teacher), shards=urls)
    assert store.augmentations == 3 and list(store.caption_keys) == ["txt", "syn0.txt"]
    pool = Reinforcement(store, 3, pool=True, ratio=0.5, synthetic=("syn0.txt",))
    items = [item for _, item in zip(range(32), ShardStream(urls, 64, seed=9, shuffle_buffer=5, reinforcement=pool))]
    live = load_teacher(teacher, 0.5, None)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    batch = ClipCollator(tokenizer, 32)([(pixels, caption) for pixels, caption, *_ in items])
    images, texts, _ = live.embed(split_inputs(batch)[1])
    targets = stack_targets([item[2] for item in items])
    torch.testing.assert_close(targets[0][0], images, rtol=0, atol=1e-6)
    torch.testing.assert_close(targets[1][0], texts, rtol=0, atol=1e-6)
    # what those 32 samples (two passes over the 16) were drawn with: every augmentation and both captions
    with tarfile.open(urls[0]) as tar:
        keys = {m.name.split(".", 1)[0] for m in tar.getmembers()}
    chosen = {pool.choose(9, epoch, key) for epoch in (0, 1) for key in keys}
    assert {i for i, _ in chosen} == {0, 1, 2} and {c for _, c in chosen} == {"txt", "syn0.txt"}
    assert {int(item[3][3]) for item in items} == {0, 1}


def _by_key(items) -> dict:
    """{(pass, key): (pixels, caption, targets)} of pooled stream items (the fake store's rows name their key)."""
    return {(int(item[3][3]), f"{int(item[2][0][0][0]):09d}"): item[:3] for item in items}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k][0], b[k][0]) and a[k][1] == b[k][1] and a[k][2][1][1].tolist() == b[k][2][1][1].tolist()
        for k in a
    )


def test_a_sample_gets_the_same_crop_caption_and_targets_on_any_reader_and_after_a_resume(tmp_path):
    """The choices follow the sample, not the reader: 2 readers (ranks) between them yield, per (pass, key), what 1
    reader yields; a stream restored from a position continues with what the uninterrupted one yielded next."""
    from disco_clip_ds.data.streams.shards import ShardStream

    urls = write_shards(tmp_path / "data", num_shards=2, per_shard=8, seed=4)
    for url in urls:
        add_synthetic_captions(url)
    pool = dict(reinforcement=Reinforcement(FakeStore(4), 4, pool=True, ratio=0.5, synthetic=("syn0.txt",)))
    options = dict(seed=2, shuffle_buffer=3, **pool)
    one = [item for _, item in zip(range(32), ShardStream(urls, 16, **options))]  # two passes
    two = [
        item for rank in (0, 1) for _, item in zip(range(16), ShardStream(urls, 16, rank=rank, world_size=2, **options))
    ]
    assert _same(_by_key(one), _by_key(two))
    resumed = ShardStream(urls, 16, **options)
    resumed.restore({0: tuple(one[10][3][1:].tolist())}, consumed_batches=0)
    assert _same(_by_key([item for _, item in zip(range(21), resumed)]), _by_key(one[11:]))
