"""DiscoCLIPModel and DiscoSiglipModel: transformers' CLIPModel and SiglipModel whose forward returns the
global-batch loss of `disco_clip_ds.losses` (CLIP's softmax loss, SigLIP's sigmoid loss).

One mixin, `GlobalBatchLossMixin`, gives both models their forward (towers -> normalised embeddings -> the loss
of `config.loss_impl`), their save as the plain transformers model and their ZeRO-3 initialisation; each model
adds only its logit parameters, its own per-device loss and its initialisation. The loss is computed inside
`forward`, so the stock Trainer, the DeepSpeed engine, accelerate and ZeRO-3's partitioned parameters need no
special casing.

A fresh model (and any weight a checkpoint lacks) is initialised as OpenAI's CLIP and open_clip initialise theirs
(`clip_init_`), not as transformers' CLIPModel does: that one swaps the attention scales and uses other positional
and vision-tower stds, and trains to a markedly higher loss at equal steps (bench/vs_open_clip/).

Under deepspeed releases that cannot broadcast a 0-dim parameter the model holds CLIP's `logit_scale` as a
1-element vector (compat.py); its state dict, its `save_pretrained` output and its `from_pretrained` input keep
CLIP's 0-dim layout, so checkpoints stay CLIPModel-compatible in both directions.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, CLIPConfig, CLIPModel, CLIPTextConfig, SiglipConfig, SiglipModel
from transformers import initialization as init
from transformers.models.clip.modeling_clip import (
    CLIPMLP,
    CLIPAttention,
    CLIPOutput,
    CLIPTextEmbeddings,
    CLIPVisionEmbeddings,
    image_text_contrastive_loss,
)
from transformers.models.siglip.modeling_siglip import SiglipOutput

from disco_clip_ds import LOSS_IMPLS, compat
from disco_clip_ds.losses import disco_clip_loss
from disco_clip_ds.losses.sigmoid import sigmoid_loss

LOGIT_SCALE_MAX = math.log(100.0)  # CLIP clamps the temperature at 100
SIGLIP_LOGIT_SCALE_INIT, SIGLIP_LOGIT_BIAS_INIT = math.log(10.0), -10.0  # the SigLIP paper's initialisation


class GlobalBatchLossMixin:
    """What DiscoCLIPModel and DiscoSiglipModel share; mix in before the transformers model class.

    A model supplies `PLAIN` (the transformers class it saves as), `IMPLS` (its loss_impl values), `OUTPUT` (its
    output class, with `logit_scale` and any further logit parameter), `logit_params()` (the tensors the loss takes
    after the features, e.g. (multiplier,) or (multiplier, bias)), `logits(text, image, params)`, `local_loss`
    (its own per-device loss on those logits) and `global_loss(image, text, *params, group=None)`.
    """

    PLAIN: type
    IMPLS: tuple[str, ...]
    OUTPUT: type

    def _adopt_loss_config(self, config) -> None:
        config.loss_impl = getattr(config, "loss_impl", None) or "tiled"
        config.chunk_size = getattr(config, "chunk_size", None)
        if config.loss_impl not in self.IMPLS:
            raise ValueError(
                f"loss_impl must be one of {self.IMPLS} for {self.PLAIN.__name__}, got {config.loss_impl!r}"
            )

    def initialize_weights(self) -> None:
        """As transformers', but under ZeRO-3 on gathered weights: the models build their towers with
        `_from_config`, which partitions them inside zero.Init, and a plain init would write into their empty shards."""
        from transformers.integrations import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled() and any(hasattr(p, "ds_id") for p in self.parameters()):
            from transformers.integrations.deepspeed import initialize_weights_zero3

            initialize_weights_zero3(self)
        else:
            super().initialize_weights()

    def save_pretrained(self, save_directory, *args, state_dict=None, is_main_process: bool = True, **kwargs):
        """Save as the plain transformers model (its class in `architectures`)."""
        state_dict = self._plain_state_dict(state_dict)
        super().save_pretrained(save_directory, *args, state_dict=state_dict, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            config_file = Path(save_directory) / "config.json"
            config = json.loads(config_file.read_text())
            config["architectures"] = [self.PLAIN.__name__]
            config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """As the transformers model's `from_pretrained` (hub id or folder)."""
        model = super().from_pretrained(*args, **kwargs)
        compat.clear_weight_conversions(model)  # our state dict is the checkpoint layout: saving must not transform
        return model

    def _plain_state_dict(self, state_dict: dict | None) -> dict | None:
        return state_dict

    def _initialize_weights(self, module: nn.Module, is_custom_code: bool = False) -> None:
        compat.init_as_library_code(super()._initialize_weights)(module, is_custom_code)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        return_loss: bool | None = None,
        interpolate_pos_encoding: bool = False,
        return_logits: bool | None = None,
        **kwargs,
    ):
        """The transformers model's forward; with `return_loss` the loss is the global-batch one of
        `config.loss_impl` (or the model's own per-device loss for "local").

        `return_logits`: whether to build this rank's b x b logits (`logits_per_image` / `logits_per_text`).
        Default: when no loss is asked for (inference, as the transformers model) or the loss is `local`, which
        uses them; a training step with the global loss skips them (64 MiB of fp32 at b = 4096) and returns None.
        """
        vision_outputs = self.get_image_features(
            pixel_values=pixel_values, interpolate_pos_encoding=interpolate_pos_encoding, **kwargs
        )
        text_outputs = self.get_text_features(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        )
        image_embeds = nn.functional.normalize(vision_outputs.pooler_output, dim=-1)
        text_embeds = nn.functional.normalize(text_outputs.pooler_output, dim=-1)
        params = self.logit_params()
        self.last_logit_scale = params[0].detach()  # for logging: under ZeRO-3 the parameter is partitioned
        if return_logits is None:
            return_logits = not return_loss or self.config.loss_impl == "local"
        logits_per_text = self.logits(text_embeds, image_embeds, params) if return_logits else None
        loss = None
        if return_loss:
            if self.config.loss_impl == "local":
                local = (
                    logits_per_text if logits_per_text is not None else self.logits(text_embeds, image_embeds, params)
                )
                loss = self.local_loss(local)
            else:
                # fp32 logits even under autocast (Trainer --bf16 without DeepSpeed): the loss turns it off itself.
                loss = self.global_loss(image_embeds, text_embeds, *params)
        return self.OUTPUT(
            loss=loss,
            logits_per_image=logits_per_text.t() if logits_per_text is not None else None,
            logits_per_text=logits_per_text,
            text_embeds=text_embeds,
            image_embeds=image_embeds,
            text_model_output=text_outputs,
            vision_model_output=vision_outputs,
            **dict(zip(self.PARAM_NAMES, params)),
        )


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

    PLAIN, IMPLS, OUTPUT, PARAM_NAMES = CLIPModel, LOSS_IMPLS, DiscoCLIPOutput, ("logit_scale",)

    def __init__(self, config: CLIPConfig):
        super().__init__(config)
        # CLIP's initialisation (`clip_init_`). The towers are sub-models that transformers initialises with their
        # own `_init_weights`, at construction and for a checkpoint's missing weights alike, so they get ours too.
        for tower in (self.text_model, self.vision_model):
            tower._init_weights = _with_clip_init(tower._init_weights)
            tower._initialize_weights = compat.init_as_library_code(tower._initialize_weights)
        # transformers' rules already ran while CLIPModel built the towers: run the init again, now with CLIP's.
        # Under from_pretrained, transformers disables `init_weights` during construction, so this is a no-op there.
        for module in self.modules():
            module.__dict__.pop("_is_hf_initialized", None)
        self.init_weights()
        self._adopt_loss_config(config)
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

    PLAIN, IMPLS, OUTPUT, PARAM_NAMES = (
        SiglipModel,
        ("tiled", "local"),
        DiscoSiglipOutput,
        ("logit_scale", "logit_bias"),
    )

    def __init__(self, config: SiglipConfig):
        super().__init__(config)
        self._adopt_loss_config(config)

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


def build_model(
    model_name_or_path: str | None = None,
    model_config: str | None = None,
    loss_impl: str = "tiled",
    chunk_size: int | None = None,
) -> DiscoCLIPModel | DiscoSiglipModel:
    """A DiscoCLIPModel or DiscoSiglipModel (by the config's model_type) from pretrained weights (hub id or folder)
    or fresh from a config JSON file."""
    if bool(model_name_or_path) == bool(model_config):
        raise ValueError("give exactly one of model_name_or_path (pretrained weights) or model_config (a config JSON)")
    config = load_config(model_name_or_path, model_config)
    model_class = MODEL_CLASSES.get(config.model_type)
    if model_class is None:
        raise ValueError(f"model_type {config.model_type!r} is not one of {sorted(MODEL_CLASSES)}")
    config.loss_impl, config.chunk_size = loss_impl, chunk_size
    if model_name_or_path:
        return model_class.from_pretrained(model_name_or_path, config=config)
    return model_class(config)


MODEL_CLASSES = {"clip": DiscoCLIPModel, "siglip": DiscoSiglipModel}


def load_config(model_name_or_path: str | None = None, model_config: str | None = None):
    """The CLIPConfig or SiglipConfig of pretrained weights (hub id or folder) or of a config JSON file."""
    if model_name_or_path:
        return AutoConfig.from_pretrained(model_name_or_path)
    path = Path(model_config)
    if not path.is_file():
        raise FileNotFoundError(f"model config {path} not found (e.g. recipes/models/tiny.json)")
    return _config_from_json(path)


def _config_from_json(path: Path):
    model_type = json.loads(path.read_text()).get("model_type", "clip")  # a CLIPConfig JSON may omit it
    config_class = {"clip": CLIPConfig, "siglip": SiglipConfig}.get(model_type)
    if config_class is None:
        raise ValueError(f"{path}: model_type {model_type!r} is not one of clip, siglip")
    return config_class.from_json_file(str(path))
