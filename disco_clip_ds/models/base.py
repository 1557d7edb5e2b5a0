"""The global-batch loss mixin: what DiscoCLIPModel (models/clip.py) and DiscoSiglipModel (models/siglip.py) share.

`GlobalBatchLossMixin` gives both models their forward (towers -> normalised embeddings -> the loss of
`config.loss_impl`), their save as the plain transformers model and their ZeRO-3 initialisation; each model adds
only its logit parameters, its own per-device loss and its initialisation. The loss is computed inside `forward`,
so the stock Trainer, the DeepSpeed engine, accelerate and ZeRO-3's partitioned parameters need no special casing.

Initial weights are drawn by name (`drawn_by_name`): each parameter's random values come from a generator seeded by
the seed and the parameter's name, drawn on the CPU in float32, so that a fresh model is the same under any ZeRO stage,
world size, device or global RNG state; the rules (which distribution, which scale) stay each model's own.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
from pathlib import Path

import torch
from torch import nn

from disco_clip_ds import compat
from disco_clip_ds.models.patch_dropout import PatchDropout

# The seed of a fresh model's draws (build_model's `seed`); None: torch.initial_seed(), the seed of the last
# torch.manual_seed (transformers' set_seed), whatever the global generator drew since.
_init_seed = contextvars.ContextVar("init_seed", default=None)

# The random init primitives transformers' rules reach (transformers.initialization looks each up in this table
# at every call, and guard_torch_init_functions routes torch.nn.init's through them); each takes `generator`.
RANDOM_INITS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


@contextlib.contextmanager
def init_seed(seed: int | None):
    """Models built inside draw their initial weights with `seed` (None: torch.initial_seed())."""
    token = _init_seed.set(seed)
    try:
        yield
    finally:
        _init_seed.reset(token)


def name_seed(seed: int, name: str) -> int:
    """The generator seed of parameter `name`'s initial values: the first 8 bytes of sha256("SEED:NAME"), 63 bits."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@contextlib.contextmanager
def drawn_by_name(model: nn.Module, seed: int):
    """While inside, every random init of one of `model`'s parameters or buffers through transformers' init
    functions draws from a fresh CPU generator seeded by `name_seed(seed, name)`, in float32, then is copied in.

    The values then depend on the seed, the name and the rule only: not on which rank draws them, on the order of the
    draws, on the global RNG's state, on the device (ZeRO-3 gathers onto the accelerator) or on the dtype. A tensor
    that is no parameter or buffer of `model` draws as before."""
    from transformers import initialization

    names = {id(t): n for n, t in (*model.named_parameters(), *model.named_buffers())}
    table = initialization.TORCH_INIT_FUNCTIONS
    originals = {name: table[name] for name in RANDOM_INITS}
    try:
        for name, draw in originals.items():
            table[name] = _by_name(draw, names, seed)
        yield
    finally:
        table.update(originals)


def _by_name(draw, names: dict, seed: int):
    def init_(tensor: torch.Tensor, *args, generator=None, **kwargs) -> torch.Tensor:
        name = names.get(id(tensor))
        if name is None or generator is not None:
            return draw(tensor, *args, generator=generator, **kwargs)
        values = torch.empty(tensor.shape, dtype=torch.float32)
        draw(values, *args, generator=torch.Generator().manual_seed(name_seed(seed, name)), **kwargs)
        with torch.no_grad():
            return tensor.copy_(values)

    return init_


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
    CLASS_TOKENS: int  # the image tower's tokens ahead of its patches (CLIP's class token; none in SigLIP)

    def _adopt_loss_config(self, config) -> None:
        config.loss_impl = getattr(config, "loss_impl", None) or "tiled"
        config.chunk_size = getattr(config, "chunk_size", None)
        if config.loss_impl not in self.IMPLS:
            raise ValueError(
                f"loss_impl must be one of {self.IMPLS} for {self.PLAIN.__name__}, got {config.loss_impl!r}"
            )

    def _add_patch_dropout(self) -> None:
        """The image tower's patch dropout, applied to the batches that carry kept patches (`forward`'s
        `patch_keep`); a hook, not a module: nothing of it is saved."""
        self.patch_dropout = PatchDropout(self.vision_model.embeddings, self.CLASS_TOKENS)

    def _init_every_module(self) -> None:
        """At construction: run the init again on every module, now at the top, drawn by name. Each tower's own
        `post_init` (transformers builds them with `_from_config`) already initialised it from the global generator
        and marked it done, so the top model's init would skip it. Under `from_pretrained` transformers disables
        `init_weights` during construction, so this is a no-op there. The towers are initialised as library code
        (compat.init_as_library_code), as the top model is."""
        from transformers import PreTrainedModel

        for module in self.modules():
            module.__dict__.pop("_is_hf_initialized", None)
            if isinstance(module, PreTrainedModel) and module is not self:
                module._initialize_weights = compat.init_as_library_code(module._initialize_weights)
        self.init_weights()

    def initialize_weights(self) -> None:
        """As transformers', with each parameter drawn by its name (`drawn_by_name`), and under ZeRO-3 on gathered
        weights: the models build their towers with `_from_config`, which partitions them inside zero.Init, and a
        plain init would write into their empty shards."""
        from transformers.integrations import is_deepspeed_zero3_enabled

        seed = _init_seed.get()
        with drawn_by_name(self, torch.initial_seed() if seed is None else seed):
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

    def image_features(self, pixel_values, patch_keep=None, interpolate_pos_encoding=False, image_inputs=None, **kw):
        """The image tower's output on `pixel_values`, keeping the patches `patch_keep` names (patch dropout).
        `image_inputs` (NaFlex's) must be unset: a model that takes them overrides this."""
        if any(v is not None for v in (image_inputs or {}).values()):
            raise ValueError(f"{type(self).__name__} takes no pixel_attention_mask or spatial_shapes (SigLIP 2 only)")
        with self.patch_dropout.kept(patch_keep):
            return self.get_image_features(
                pixel_values=pixel_values, interpolate_pos_encoding=interpolate_pos_encoding, **kw
            )

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        return_loss: bool | None = None,
        interpolate_pos_encoding: bool = False,
        return_logits: bool | None = None,
        patch_keep: torch.LongTensor | None = None,
        pixel_attention_mask: torch.Tensor | None = None,
        spatial_shapes: torch.LongTensor | None = None,
        **kwargs,
    ):
        """The transformers model's forward; with `return_loss` the loss is the global-batch one of
        `config.loss_impl` (or the model's own per-device loss for "local").

        `patch_keep` (batch, kept): the patches each image keeps (patch dropout, models/patch_dropout.py); None: all.

        `pixel_attention_mask`, `spatial_shapes`: NaFlex's image inputs (SigLIP 2 only, models/siglip2.py).

        `return_logits`: whether to build this rank's b x b logits (`logits_per_image` / `logits_per_text`).
        Default: when no loss is asked for (inference, as the transformers model) or the loss is `local`, which
        uses them; a training step with the global loss skips them (64 MiB of fp32 at b = 4096) and returns None.
        """
        naflex = {"pixel_attention_mask": pixel_attention_mask, "spatial_shapes": spatial_shapes}
        vision_outputs = self.image_features(pixel_values, patch_keep, interpolate_pos_encoding, naflex, **kwargs)
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


def gather_attention_output_projections(model: nn.Module) -> None:
    """Under ZeRO-3, each torch `nn.MultiheadAttention`'s output projection (SigLIP's attention-pooling head) registered
    as an external parameter of the attention module: its forward reads `out_proj.weight` and `.bias` itself
    (`F.multi_head_attention_forward`), never through `out_proj`'s own forward, so ZeRO-3 would not gather them. Without
    it only DeepSpeed's automatic discovery gathers them, inside the engine's forward alone: the tower called directly
    (`get_image_features`, an evaluation before the first training step) would read an empty partition. Nothing
    otherwise."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return
    from deepspeed.runtime.zero import register_external_parameter

    for module in model.modules():
        if isinstance(module, nn.MultiheadAttention):
            for weight in (module.out_proj.weight, module.out_proj.bias):
                if weight is not None:
                    register_external_parameter(module, weight)
