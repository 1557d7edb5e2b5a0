"""disco-clip-ds: the DisCo-CLIP distributed contrastive loss, trained with HF transformers under DeepSpeed."""

__version__ = "0.1.0"

__all__ = ["DiscoClipLoss", "disco_clip_loss", "DiscoCLIPModel"]


def __getattr__(name):
    # Lazy so that `import disco_clip_ds` (and `disco-clip --help`) stays fast and transformers-free.
    if name in ("DiscoClipLoss", "disco_clip_loss"):
        from . import loss

        return getattr(loss, name)
    if name == "DiscoCLIPModel":
        from .modeling import DiscoCLIPModel

        return DiscoCLIPModel
    raise AttributeError(f"module 'disco_clip_ds' has no attribute {name!r}")
