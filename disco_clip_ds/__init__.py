"""disco-clip-ds: the DisCo-CLIP distributed contrastive loss, trained with HF transformers under DeepSpeed."""

__version__ = "0.1.0"

# The loss vocabulary, here so that the CLI, the model and the planner read one list without importing torch:
# losses/'s two global-batch losses, and CLIP's own per-device loss.
LOSS_IMPLS = ("tiled", "disco", "local")

__all__ = ["DiscoClipLoss", "disco_clip_loss", "DiscoCLIPModel"]


def __getattr__(name):
    # Lazy so that `import disco_clip_ds` (and `disco-clip --help`) stays fast and transformers-free.
    if name in ("DiscoClipLoss", "disco_clip_loss"):
        from disco_clip_ds import losses

        return getattr(losses, name)
    if name == "DiscoCLIPModel":
        from disco_clip_ds.models.clip import DiscoCLIPModel

        return DiscoCLIPModel
    raise AttributeError(f"module 'disco_clip_ds' has no attribute {name!r}")
