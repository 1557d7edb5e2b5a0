"""DiscoCLIPModel: transformers' CLIPModel whose forward returns CLIP's softmax loss over the global batch
(`disco_clip_ds.losses`, through models/base.py's GlobalBatchLossMixin).

A fresh model (and any weight a checkpoint lacks) is initialised as OpenAI's CLIP and open_clip initialise theirs
(`clip_init_`), not as transformers' CLIPModel does: that one swaps the attention scales and uses other positional
and vision-tower stds, and trains to a markedly higher loss at equal steps (bench/vs_open_clip/).

Under deepspeed releases that cannot broadcast a 0-dim parameter the model holds CLIP's `logit_scale` as a
1-element vector (compat.py); its state dict, its `save_pretrained` output and its `from_pretrained` input keep
CLIP's 0-dim layout, so checkpoints stay CLIPModel-compatible in both directions.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import CLIPConfig, CLIPModel, CLIPTextConfig
from transformers import initialization as init
from transformers.models.clip.modeling_clip import (
    CLIPMLP,
    CLIPAttention,
    CLIPOutput,
    CLIPTextEmbeddings,
    CLIPVisionEmbeddings,
    image_text_contrastive_loss,
)

from disco_clip_ds import LOSS_IMPLS, compat
from disco_clip_ds.losses import disco_clip_loss
from disco_clip_ds.models.base import GlobalBatchLossMixin

LOGIT_SCALE_MAX = math.log(100.0)  # CLIP clamps the temperature at 100


@dataclass
class DiscoCLIPOutput(CLIPOutput):
    """CLIPOutput plus `logit_scale`: the clamped multiplier exp(logit_scale) as used by the loss, still attached to
    the graph, so that a caller can recompute the loss outside `forward` (contrastive accumulation does)."""

    logit_scale: torch.Tensor | None = None


class DiscoCLIPModel(GlobalBatchLossMixin, CLIPModel):
    """CLIPModel with the distributed contrastive loss (`disco_clip_ds.losses`) computed in `forward`.

    Config attributes: `loss_impl` ("tiled" default, "disco", or "local" = CLIP's own per-device loss)
    and `chunk_size` (tile size of the tiled loss; None = the loss module's default).
    Under torch.distributed, `forward(..., return_loss=True).loss` on each rank is such that the mean over
    ranks is the global-batch loss and data-parallel gradient averaging yields the global-batch gradient.
    """

    CLASS_TOKENS = 1
    PLAIN, IMPLS, OUTPUT, PARAM_NAMES = CLIPModel, LOSS_IMPLS, DiscoCLIPOutput, ("logit_scale",)

    def __init__(self, config: CLIPConfig):
        super().__init__(config)
        # CLIP's initialisation (`clip_init_`). The towers are sub-models that transformers initialises with their
        # own `_init_weights`, at construction and for a checkpoint's missing weights alike, so they get ours too.
        for tower in (self.text_model, self.vision_model):
            tower._init_weights = _with_clip_init(tower._init_weights)
        # transformers' rules already ran while CLIPModel built the towers: run the init again, now with CLIP's.
        self._init_every_module()
        self._adopt_loss_config(config)
        self._add_patch_dropout()
        compat.adopt_vector_logit_scale(self)

    def _init_weights(self, module: nn.Module) -> None:
        """transformers' init, overridden by OpenAI CLIP's and open_clip's where they differ (`clip_init_`).

        transformers calls this through `initialize_weights` for a fresh model and, in `from_pretrained`, only for
        weights the checkpoint lacks: the `transformers.initialization` functions skip loaded tensors."""
        super()._init_weights(module)
        clip_init_(module)

    def get_input_embeddings(self) -> nn.Module:
        """The text tower's token embedding, as CLIPTextModel's. CLIPModel (transformers 5) raises instead, and
        accelerate's FSDP2 setup asks every model for it (to shard it as a unit of its own)."""
        return self.text_model.embeddings.token_embedding

    def _plain_state_dict(self, state_dict: dict | None) -> dict | None:
        return compat.scalar_logit_scale_in(state_dict)  # CLIP's 0-dim logit_scale (see compat)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """As `CLIPModel.from_pretrained` (hub id or folder); loads any CLIPModel checkpoint."""
        from transformers.integrations import is_deepspeed_zero3_enabled

        load = functools.partial(super().from_pretrained, *args, **kwargs)
        return compat.load_with_vector_logit_scale(load, zero3=is_deepspeed_zero3_enabled())

    def clamped_logit_scale(self) -> torch.Tensor:
        """The logit multiplier exp(logit_scale), clamped at 100 as in CLIP, as a 0-dim tensor."""
        return self.logit_scale.clamp(max=LOGIT_SCALE_MAX).exp().reshape(())

    def logit_params(self) -> tuple[torch.Tensor]:
        return (self.clamped_logit_scale(),)

    def logits(self, text_embeds, image_embeds, params) -> torch.Tensor:
        return params[0] * text_embeds @ image_embeds.t()

    def local_loss(self, logits_per_text) -> torch.Tensor:
        return image_text_contrastive_loss(logits_per_text)

    def global_loss(self, image_embeds, text_embeds, logit_scale, group=None) -> torch.Tensor:
        impl, chunk = self.config.loss_impl, self.config.chunk_size
        return disco_clip_loss(image_embeds, text_embeds, logit_scale, impl=impl, chunk_size=chunk, group=group)


def _torch_linear_init_(linear: nn.Linear) -> None:
    # torch's nn.Linear.reset_parameters: kaiming_uniform_(a=sqrt(5)) is U(+-1/sqrt(fan_in)), bias the same bound.
    bound = linear.in_features**-0.5
    init.uniform_(linear.weight, -bound, bound)
    if linear.bias is not None:
        init.uniform_(linear.bias, -bound, bound)


def _with_clip_init(hf_init):
    def init_weights(module: nn.Module) -> None:
        hf_init(module)
        clip_init_(module)

    return init_weights


def clip_init_(module: nn.Module) -> None:
    """Initialise `module`'s own and direct children's weights as OpenAI CLIP and open_clip 3.3.0 do, mapped to
    transformers' CLIP layout (per-head q/k/v/out_proj Linears, fc1/fc2, bias-free projection Linears).

    Sources: OpenAI CLIP `clip/model.py` (`CLIP.initialize_parameters`, `VisionTransformer.__init__`); open_clip
    `src/open_clip/transformer.py` (`TextTransformer.init_parameters`; `VisionTransformer.init_parameters` is a
    no-op, so the vision tower keeps torch's default layer inits) and `model.py` (`logit_scale`). Text blocks use
    width w and depth L: attn_std = w^-0.5, proj_std = w^-0.5 * (2L)^-0.5, fc_std = (2w)^-0.5. LayerNorms (1, 0)
    are left to transformers, which matches torch's default. Touches only tensors the caller may gather under
    ZeRO-3 (transformers' `initialize_weights_zero3` gathers a module's own and its direct children's)."""
    if isinstance(module, CLIPTextEmbeddings):
        # CLIP.initialize_parameters / TextTransformer.init_parameters: token 0.02, positional 0.01.
        init.normal_(module.token_embedding.weight, std=0.02)
        init.normal_(module.position_embedding.weight, std=0.01)
    elif isinstance(module, CLIPVisionEmbeddings):
        # VisionTransformer.__init__: class_embedding and positional_embedding are scale * randn, scale = w^-0.5.
        scale = module.embed_dim**-0.5
        init.normal_(module.class_embedding, std=scale)
        init.normal_(module.position_embedding.weight, std=scale)
        # conv1 = nn.Conv2d(..., bias=False) with torch's default: kaiming_uniform_(a=sqrt(5)) = U(+-1/sqrt(fan_in)).
        bound = (module.config.num_channels * module.patch_size**2) ** -0.5
        init.uniform_(module.patch_embedding.weight, -bound, bound)
    elif isinstance(module, CLIPAttention):
        # nn.MultiheadAttention._reset_parameters zeroes in_proj_bias and out_proj.bias in both towers.
        for linear in (module.q_proj, module.k_proj, module.v_proj, module.out_proj):
            init.zeros_(linear.bias)
        width, layers = module.config.hidden_size, module.config.num_hidden_layers
        if isinstance(module.config, CLIPTextConfig):
            # init_parameters: in_proj_weight ~ N(0, attn_std) (q, k and v are its three row blocks),
            # out_proj.weight ~ N(0, proj_std).
            for linear in (module.q_proj, module.k_proj, module.v_proj):
                init.normal_(linear.weight, std=width**-0.5)
            init.normal_(module.out_proj.weight, std=width**-0.5 * (2 * layers) ** -0.5)
        else:
            # torch's MultiheadAttention default: xavier_uniform_ on the stacked (3w, w) in_proj_weight, i.e.
            # U(+-sqrt(6 / (w + 3w))) for each of q, k, v; out_proj is an nn.Linear with its default weight init.
            bound = (6 / (4 * width)) ** 0.5
            for linear in (module.q_proj, module.k_proj, module.v_proj):
                init.uniform_(linear.weight, -bound, bound)
            bound = width**-0.5
            init.uniform_(module.out_proj.weight, -bound, bound)
    elif isinstance(module, CLIPMLP):
        # c_fc / c_proj are nn.Linear: their biases (and, in the vision tower, weights) keep torch's default.
        _torch_linear_init_(module.fc1)
        _torch_linear_init_(module.fc2)
        if isinstance(module.config, CLIPTextConfig):
            # init_parameters: c_fc.weight ~ N(0, fc_std), c_proj.weight ~ N(0, proj_std).
            width, layers = module.config.hidden_size, module.config.num_hidden_layers
            init.normal_(module.fc1.weight, std=(2 * width) ** -0.5)
            init.normal_(module.fc2.weight, std=width**-0.5 * (2 * layers) ** -0.5)
    elif isinstance(module, CLIPModel):
        # text_projection ~ N(0, w_text^-0.5) (init_parameters); visual proj = scale * randn, scale = w_vision^-0.5
        # (VisionTransformer.__init__). Both are (in, out) matrices there, transposed Linear weights here.
        init.normal_(module.text_projection.weight, std=module.text_embed_dim**-0.5)
        init.normal_(module.visual_projection.weight, std=module.vision_embed_dim**-0.5)
        # CLIP: logit_scale = ln(1 / 0.07); the config's logit_scale_init_value (2.6592 in transformers' default).
        init.constant_(module.logit_scale, module.config.logit_scale_init_value)
