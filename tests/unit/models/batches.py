"""The model tests' batch and tolerances (test_clip.py, test_siglip.py)."""

GLOBAL_BATCH = 6
# The models run in float64; the loss accumulates in float32 by design (losses/), so agreement is at fp32 level.
LOSS_RTOL = 1e-6


def assert_grad_close(actual, expected, name):
    """ACTUAL within fp32 accumulation error of EXPECTED (1e-5 of its largest magnitude)."""
    err = (actual - expected).abs().max().item()
    assert err <= 1e-5 * expected.abs().max().item() + 1e-12, f"{name}: max error {err}"


def batch(dtype=None, n=GLOBAL_BATCH):
    """A fixed batch of N tokenised texts (recipes/tokenizer's ids, random lengths) and 64 x 64 images (DTYPE,
    float64 by default) for the tiny model configs."""
    import torch

    dtype = dtype or torch.float64
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 10, (n,), generator=g)
    ids = torch.ones(n, 12, dtype=torch.long)  # eos = pad = 1, as in recipes/tokenizer
    for i, length in enumerate(lengths):
        ids[i, 0], ids[i, 1:length] = 0, torch.randint(2, 539, (length - 1,), generator=g)
    mask = (torch.arange(12) <= lengths[:, None]).long()
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "pixel_values": torch.randn(n, 3, 64, 64, generator=g, dtype=dtype),
    }


# Each image's (patch rows, patch columns) in `naflex_batch`: square, wide, tall, small, the whole budget, one row.
NAFLEX_SHAPES = ((8, 8), (6, 12), (14, 4), (3, 5), (16, 16), (1, 16))


def naflex_batch(dtype=None, n=GLOBAL_BATCH, budget=256, patch_dim=48):
    """`batch`'s texts with NaFlex images (SigLIP 2): random patches (n, budget, patch_dim) padded to the budget,
    `pixel_attention_mask` 1 on each image's rows x columns patches, `spatial_shapes` from NAFLEX_SHAPES."""
    import torch

    inputs = batch(dtype, n)
    shapes = torch.tensor([NAFLEX_SHAPES[i % len(NAFLEX_SHAPES)] for i in range(n)])
    g = torch.Generator().manual_seed(2)
    mask = (torch.arange(budget) < shapes.prod(-1)[:, None]).long()
    pixels = torch.randn(n, budget, patch_dim, generator=g, dtype=inputs["pixel_values"].dtype) * mask[..., None]
    inputs.update(pixel_values=pixels, pixel_attention_mask=mask, spatial_shapes=shapes)
    return inputs
