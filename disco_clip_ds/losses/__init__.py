"""CLIP's contrastive loss over the global batch of all ranks: `softmax.py` computes each rank's share, `comm.py`
moves the features between ranks (all-gather forward, reduce-scatter of their gradient backward)."""

from disco_clip_ds.losses.comm import gather_features
from disco_clip_ds.losses.softmax import DEFAULT_KEEP_BYTES, IMPLS, DiscoClipLoss, default_chunk_size, disco_clip_loss

__all__ = ["DEFAULT_KEEP_BYTES", "IMPLS", "DiscoClipLoss", "default_chunk_size", "disco_clip_loss", "gather_features"]
