"""CLIP's contrastive loss over the global batch of all ranks: `softmax.py` computes each rank's share, `comm.py`
moves the features between ranks (all-gather forward, reduce-scatter of their gradient backward) and agrees on their
shapes; `sigmoid.py` is SigLIP's loss and `distill.py` a teacher's similarities distilled into the student, both over
the global batch too; `tiles.py` is how they walk their logits (tiles, the ring) and the options they share."""

from disco_clip_ds.losses.comm import gather_features
from disco_clip_ds.losses.softmax import DEFAULT_KEEP_BYTES, IMPLS, DiscoClipLoss, default_chunk_size, disco_clip_loss

__all__ = ["DEFAULT_KEEP_BYTES", "IMPLS", "DiscoClipLoss", "default_chunk_size", "disco_clip_loss", "gather_features"]
