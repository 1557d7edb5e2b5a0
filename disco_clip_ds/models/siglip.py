"""DiscoSiglipModel: transformers' SiglipModel whose forward returns SigLIP's sigmoid loss over the global batch
(`disco_clip_ds.losses.sigmoid`, through models/base.py's GlobalBatchLossMixin), its logit parameters initialised
as the SigLIP paper's."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import SiglipConfig, SiglipModel
from transformers import initialization as init
from transformers.models.siglip.modeling_siglip import SiglipOutput

from disco_clip_ds.losses.sigmoid import sigmoid_loss
from disco_clip_ds.models.base import GlobalBatchLossMixin

SIGLIP_LOGIT_SCALE_INIT, SIGLIP_LOGIT_BIAS_INIT = math.log(10.0), -10.0  # the SigLIP paper's initialisation


@dataclass
class DiscoSiglipOutput(SiglipOutput):
    """SiglipOutput plus the multiplier exp(logit_scale) and the bias as the loss used them, still attached to the
    graph (contrastive accumulation recomputes the loss outside `forward`)."""

    logit_scale: torch.Tensor | None = None
    logit_bias: torch.Tensor | None = None


class DiscoSiglipModel(GlobalBatchLossMixin, SiglipModel):
    """SiglipModel with the global-batch sigmoid loss (`disco_clip_ds.losses.sigmoid`) computed in `forward`.

    Config attributes as DiscoCLIPModel's: `loss_impl` "tiled" (the global loss, each logit once) or "local"
    (SiglipModel's own loss over the device's batch), and `chunk_size`. A fresh model (and a checkpoint without
    them) starts from the paper's logit_scale = log 10 and logit_bias = -10, not transformers' zeros. The text
    tower pools the last position: feed text padded to a fixed length, as SigLIP was trained.
    """

    CLASS_TOKENS = 0
    PLAIN, IMPLS, OUTPUT, PARAM_NAMES = (
        SiglipModel,
        ("tiled", "local"),
        DiscoSiglipOutput,
        ("logit_scale", "logit_bias"),
    )

    def __init__(self, config: SiglipConfig):
        super().__init__(config)
        self._init_every_module()  # the towers' own post_init drew from the global generator: draw them by name
        self._adopt_loss_config(config)
        self._add_patch_dropout()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, SiglipModel):
            init.constant_(module.logit_scale, SIGLIP_LOGIT_SCALE_INIT)
            init.constant_(module.logit_bias, SIGLIP_LOGIT_BIAS_INIT)

    def logit_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.logit_scale.exp().reshape(()), self.logit_bias.reshape(())

    def logits(self, text_embeds, image_embeds, params) -> torch.Tensor:
        return params[0] * text_embeds @ image_embeds.t() + params[1]

    def local_loss(self, logits_per_text) -> torch.Tensor:
        # SiglipModel's own formula (transformers has it inline in forward): the mean over texts of the row sums.
        signs = 2 * torch.eye(len(logits_per_text), device=logits_per_text.device) - 1
        return -nn.functional.logsigmoid(signs * logits_per_text).sum(-1).mean()

    def global_loss(self, image_embeds, text_embeds, logit_scale, logit_bias, group=None) -> torch.Tensor:
        return sigmoid_loss(image_embeds, text_embeds, logit_scale, logit_bias, self.config.chunk_size, group)
