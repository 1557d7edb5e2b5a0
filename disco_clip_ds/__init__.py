"""disco-clip-ds: the DisCo-CLIP distributed contrastive loss, trained with HF transformers under DeepSpeed."""

__version__ = "0.1.0"

# The loss vocabulary, here so that the CLI, the planner and the benchmarks read one list without importing torch.
LOSS_IMPLS = ("tiled", "disco", "local")  # --loss_impl: loss.py's two global-batch losses; CLIP's per-device loss
BENCH_LOSS_IMPLS = ("naive", "disco", "twoblock", "tiled")  # compared by bench/loss_bench.py, modelled by plan.py

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
