"""DiscoSiglip2Model: transformers' Siglip2Model (SigLIP 2, NaFlex image tower) whose forward returns SigLIP's
sigmoid loss over the global batch, its logit parameters initialised as the SigLIP paper's.

Everything but the image tower's inputs is DiscoSiglipModel's: the loss, its local variant and the initialisation.
The image tower takes patchified images padded to a patch budget: `pixel_values` (batch, budget, 3 * p * p),
`pixel_attention_mask` (batch, budget), 1 on real patches, and `spatial_shapes` (batch, 2), each image's patch
rows and columns (data/naflex.py builds them as Siglip2ImageProcessor does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import Siglip2Config, Siglip2Model
from transformers import initialization as init
from transformers.models.siglip2.modeling_siglip2 import Siglip2Output

from disco_clip_ds.models.base import GlobalBatchLossMixin
from disco_clip_ds.models.siglip import SIGLIP_LOGIT_BIAS_INIT, SIGLIP_LOGIT_SCALE_INIT, DiscoSiglipModel


@dataclass
class DiscoSiglip2Output(Siglip2Output):
    """Siglip2Output plus exp(logit_scale) and the bias as the loss used them (see DiscoSiglipOutput)."""

    logit_scale: torch.Tensor | None = None
    logit_bias: torch.Tensor | None = None


class DiscoSiglip2Model(GlobalBatchLossMixin, Siglip2Model):
    """Siglip2Model with the global-batch sigmoid loss computed in `forward` (as DiscoSiglipModel).

    `forward` takes the NaFlex image inputs (`pixel_attention_mask`, `spatial_shapes`) beside `pixel_values`.
    Patch dropout is not supported: NaFlex's patch budget is the lever that bounds the image tower's tokens."""

    CLASS_TOKENS = 0
    PLAIN, OUTPUT = Siglip2Model, DiscoSiglip2Output
    IMPLS, PARAM_NAMES = DiscoSiglipModel.IMPLS, DiscoSiglipModel.PARAM_NAMES  # SigLIP's loss and its parameters
    logit_params = DiscoSiglipModel.logit_params
    logits = DiscoSiglipModel.logits
    local_loss = DiscoSiglipModel.local_loss
    global_loss = DiscoSiglipModel.global_loss

    def __init__(self, config: Siglip2Config):
        super().__init__(config)
        self._init_every_module()  # the towers' own post_init drew from the global generator: draw them by name
        self._adopt_loss_config(config)
        self.patch_dropout = None

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, Siglip2Model):
            init.constant_(module.logit_scale, SIGLIP_LOGIT_SCALE_INIT)
            init.constant_(module.logit_bias, SIGLIP_LOGIT_BIAS_INIT)

    def image_features(self, pixel_values, patch_keep=None, interpolate_pos_encoding=False, image_inputs=None, **kw):
        """The image tower's output on NaFlex inputs (`image_inputs`: pixel_attention_mask, spatial_shapes)."""
        if patch_keep is not None:
            raise ValueError("patch dropout is not supported by SigLIP 2 (NaFlex): bound tokens with max_num_patches")
        missing = [k for k in ("pixel_attention_mask", "spatial_shapes") if (image_inputs or {}).get(k) is None]
        if missing:
            raise ValueError(f"SigLIP 2 (NaFlex) needs {' and '.join(missing)} beside pixel_values")
        return self.get_image_features(pixel_values=pixel_values, **image_inputs, **kw)
