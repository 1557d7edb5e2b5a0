"""Training stream from webdataset shards: raw samples -> block shuffle -> decode and augment (streams/base.py).

Runs inside DataLoader workers. Each (rank, worker) reads a disjoint set of shards and passes over it again
and again, in a fresh order each time, so multi-epoch runs never run dry (the Trainer stops at max_steps).
Unreadable shards and corrupt or incomplete samples are skipped and counted in a counter shared by all workers.
"""

from __future__ import annotations

import itertools

from disco_clip_ds.data.redact import describe_source
from disco_clip_ds.data.reinforced import NotStored
from disco_clip_ds.data.shards import IMAGE_EXTS, epoch_order, resampled_order, shards_for_reader
from disco_clip_ds.data.streams.base import PASS_END, ReaderStream, shuffled
from disco_clip_ds.data.streams.reinforced import Reinforcement
from disco_clip_ds.data.streams.state import POSITION_FIELDS
from disco_clip_ds.data.streams.tar_samples import raw_samples

TEXT_KEYS = ("txt", "text", "caption")


class ShardStream(ReaderStream):
    """Endless stream of (uint8 pixels, caption, position) from webdataset shards (ClipCollator normalises).

    `rank`/`world_size` are this process's place among the readers (pass 0/1 when one process reads for all,
    e.g. accelerate's dispatch_batches); `num_workers`, the DataLoader workers per rank, is used to check up front
    that every reader gets a shard. Samples whose caption is empty or whitespace, and images of more than
    `max_image_pixels` pixels, are skipped. `skipped` counts skipped samples and shards, `decoded` the samples
    produced, across all workers.

    Shuffling: each pass over a reader's shards (in a fresh shard order per pass) is cut into blocks of
    `shuffle_buffer` consecutive raw (undecoded) samples; each block is read, permuted by a permutation drawn from
    (seed, reader, pass, block start), and decoded in that order. Unlike a reservoir of decoded samples, the state
    is then a handful of integers (`POSITION_FIELDS`), and `restore` resumes a reader exactly there: it re-reads one
    block's raw bytes (seeking to it within the shard) and decodes only the samples not yet produced.
    """

    position_fields = POSITION_FIELDS

    def __init__(
        self,
        urls: list[str],
        image_size: int,
        sample_ids: bool = False,
        resampled: bool = False,
        reinforcement: Reinforcement | None = None,
        **options,
    ):
        """`options`: ReaderStream's (rank, world_size, seed, shuffle_buffer, train, num_workers, max_image_pixels,
        split, micro_batch). `sample_ids`: each item also carries its (shard, sample key), before its position.
        `reinforcement` (data/streams/reinforced.py): each sample is cropped from its chosen stored augmentation,
        captioned with its chosen caption, and (when it carries targets) its item carries the teachers' stored
        embeddings of both, before its position. `resampled`: shards drawn with replacement (every reader from all of
        them) instead of each reader passing over its own share."""
        super().__init__(image_size, **options)
        self.urls, self.sample_ids, self.resampled = list(urls), sample_ids, resampled
        self.reinforcement = reinforcement
        if not resampled:  # fail early, in the main process
            shards_for_reader(self.urls, self.reader_rank * self.workers, self.num_readers)

    def state_facts(self) -> dict:
        """Readers, seed and block size (and resampling): a shard position means nothing under another of them."""
        facts = {"num_readers": self.num_readers, "seed": self.seed, "shuffle_buffer": self.block}
        return {**facts, "resampled": True} if self.resampled else facts

    def _reader_shards(self, reader: int, num_readers: int) -> list[str]:
        """The shards the reader's passes draw from: all of them when resampled, else its disjoint share."""
        return self.urls if self.resampled else shards_for_reader(self.urls, reader, num_readers)

    def _pass_order(self, shards: list[str], epoch: int, reader: int) -> list[str]:
        if self.resampled:
            return resampled_order(shards, self.seed, epoch, reader)
        return epoch_order(shards, self.seed, epoch, reader)

    def _empty_pass(self):
        reader, num_readers, _ = self._reader()
        shards = self._reader_shards(reader, num_readers)
        shown = ", ".join(map(describe_source, shards[:3]))  # a `pipe:` command may hold a credential (data/redact.py)
        shown += f" and {len(shards) - 3} more" if len(shards) > 3 else ""
        return self._nothing_readable(
            f"its shard(s) {shown}",
            "check that they exist and hold samples, or use fewer ranks x --dataloader_num_workers than there are "
            "good shards",
        )

    def _passes(self, reader: int, num_readers: int, start: list[int]):
        """(place, item) from `start` = (epoch, shard, member, offset) on, pass after pass."""
        shards = self._reader_shards(reader, num_readers)
        epoch, shard, member, offset = start or (0, 0, 0, 0)
        reread = bool(start)  # the block a resume starts in is read again
        for epoch in itertools.count(epoch):
            raw = self._raw_samples(self._pass_order(shards, epoch, reader), shard, member)
            order = (-1, -1)  # (shard index, its last stored row read) of the reinforced set
            while block := self._raw_block(raw, reread):
                reread = False
                order = self._stored_in_order(block, order)
                first_shard, first_member, _ = block[0]
                key = f"{self.seed}/block/{reader}/{epoch}/{first_shard}/{first_member}"
                for done, (_, _, sample) in shuffled(block, key, offset):
                    item = self._decode(sample, epoch)
                    if item is not None:
                        yield (epoch, first_shard, first_member, done), item
                offset = 0
            yield PASS_END
            shard, member, reread = 0, 0, False

    def _raw_block(self, raw, reread: bool) -> list:
        """The next block of raw samples. The skips its reading counts (an unreadable shard) are counted once: a
        block read again on resume was counted, in the position resumed from, when it was first read."""
        before = self.reader_skips[0]
        block = list(itertools.islice(raw, self.block))
        if reread:
            self.reader_skips[0] = before
        return block

    def _stored_in_order(self, block: list, order: tuple[int, int]) -> tuple[int, int]:
        """With a reinforced set: the stored rows of the block's samples (raw, in their shards' order) rise within each
        shard (`EmbeddingStore.check_order`: else a DataError, the sidecar's keys naming other samples' rows);
        `order` (shard index, last row) carries the check across blocks of one shard."""
        if self.reinforcement is None:
            return order
        for index, group in itertools.groupby(block, key=lambda entry: entry[0]):
            samples = [sample for _, _, sample in group]
            after = order[1] if index == order[0] else -1
            url = str(samples[0].get("__url__"))
            order = (index, self.reinforcement.store.check_order(url, [s["__key__"] for s in samples], after))
        return order

    def _raw_samples(self, order: list[str], shard: int, member: int):
        """(shard index in `order`, sample index in the shard, raw sample) from that shard and sample on."""
        for index in range(shard, len(order)):
            first = member if index == shard else 0
            try:
                for k, sample in enumerate(raw_samples(order[index], first), first):
                    yield index, k, sample
            except Exception as error:  # missing, unreadable or truncated: the samples read so far stand
                # the source as the card shows it: a `pipe:` command may hold a credential (data/redact.py)
                self._count_skip(f"unreadable shard or tar member in {describe_source(order[index])}", error)

    def _decode(self, sample: dict, epoch: int):
        key = sample.get("__key__", "?")
        what = f"sample {key} of {describe_source(str(sample.get('__url__')))}"
        image_key = next((k for k in IMAGE_EXTS if k in sample), None)
        text_key = next((k for k in TEXT_KEYS if k in sample), None)
        if image_key is None or text_key is None:
            self._count_skip(what, "no image or no caption")
            return None
        if self.reinforcement is not None:
            return self._decode_reinforced(sample, epoch, key, what, image_key)
        item = self._decode_sample(
            what, epoch, key, lambda: sample[text_key].decode("utf-8"), lambda: sample[image_key]
        )
        return (*item, (str(sample.get("__url__")), key)) if item is not None and self.sample_ids else item

    def _decode_reinforced(self, sample: dict, epoch: int, key: str, what: str, image_key: str):
        """A sample of a reinforced set: its chosen caption (the member of that extension: txt, syn0.txt, ...) and
        augmentation (the crop replayed from its stored box), then the teachers' stored embeddings of both. A sample
        without the chosen caption, or whose sidecar lacks it, is skipped and counted, as any unreadable sample."""
        index, caption = self.reinforcement.choose(self.seed, epoch, key)
        if caption not in sample:
            self._count_skip(what, f"no caption member {key}.{caption}")
            return None
        try:
            box, targets = self.reinforcement.lookup(str(sample.get("__url__")), key, index, caption)
        except NotStored as error:  # skipped and counted, as a sample without that caption member
            self._count_skip(what, error)
            return None
        item = self._decode_sample(
            what, epoch, key, lambda: sample[caption].decode("utf-8"), lambda: sample[image_key], box=box
        )
        return item if item is None or targets is None else (*item, targets)
