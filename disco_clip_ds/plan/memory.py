"""Per-GPU memory of one training step, term by term: model states (DeepSpeed's own ZeRO-2/3 estimators where
they apply, the same accounting written out for stages 0/1 and fp32), ZeRO's communication buffers, activations
(per-sample coefficients fitted on measured CPU peaks of real CLIPModels: activation_fit.json, made by
bench/plan/act_fit.py), the loss's working set per implementation, the largest parameter's transient gradient and
a fixed framework overhead; and the largest per-GPU batch, or contrastive accumulation steps, that fit.

With gradient_accumulation_steps K > 1 and contrastive accumulation (the trainer's default,
disco_clip_ds/accumulate.py) the contrastive batch is micro x world x K: activations stay those of one micro-batch,
the loss runs over all micro x world x K pairs, and each rank caches its K x micro embeddings and their gradients.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

from disco_clip_ds import LOSS_IMPLS
from disco_clip_ds.compat import zero3_init_paused
from disco_clip_ds.errors import PlanConfigError
from disco_clip_ds.plan.trainable import lock_problem, tower_locks, trainable_numels

FIT_FILE = Path(__file__).with_name("activation_fit.json")
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GiB = 2**30
# Not measurable without a GPU here: CUDA context, NCCL buffers and cuBLAS workspaces, allocator slack. A round
# figure, stated in every report; override with --overhead_gb.
DEFAULT_OVERHEAD_GB = 2.0


# The loss each model family trains with, and the implementations the package ships for it.
LOSS_FAMILIES = {"clip": "softmax", "siglip": "sigmoid", "siglip2": "sigmoid"}
FAMILY_IMPLS = {"softmax": LOSS_IMPLS, "sigmoid": ("tiled", "local")}


@dataclass
class ModelShape:
    """What the memory model needs from a CLIPConfig or SiglipConfig: tower shapes, inputs, parameter counts and the
    loss family (softmax for CLIP, sigmoid for SigLIP). `trainable` and `largest_trainable` count the parameters
    that train (all of them unless towers are locked): frozen ones have weights but no gradients and no optimizer
    state."""

    towers: dict  # name -> {"layers", "tokens", "hidden", "mlp"}; the vision tower's also "patches", "patch_pixels"
    image: tuple  # (channels, height, width)
    text_tokens: int
    projection_dim: int
    params: int
    largest_param: int
    loss: str = "softmax"
    patch_dropout: float = 0.0  # the fraction of patch tokens dropped in training (FLIP)
    trainable: int | None = None  # None: params
    largest_trainable: int | None = None  # None: largest_param

    def __post_init__(self):
        if self.trainable is None:
            self.trainable, self.largest_trainable = self.params, self.largest_param

    @classmethod
    def from_json(cls, path, lock_flags: dict | None = None, max_num_patches: int | None = None) -> "ModelShape":
        """Read a CLIPConfig, SiglipConfig or Siglip2Config JSON (models/configs.py, the one loader) and make its
        shape (`from_config`), or a PlanConfigError naming the file."""
        from disco_clip_ds.models.configs import load_config

        path = Path(path)
        if not path.is_file():
            raise PlanConfigError(
                f"--model {path}: no such file; pass a model config JSON such as recipes/models/vit_b32.json"
            )
        try:
            if not isinstance(json.loads(path.read_text()), dict):
                raise ValueError("its top level is not a JSON object")
            config = load_config(model_config=str(path))
        except (OSError, ValueError) as e:
            raise PlanConfigError(f"--model {path}: not a readable CLIPConfig or SiglipConfig JSON ({e})") from None
        return cls.from_config(config, lock_flags, max_num_patches, named=str(path))

    @classmethod
    def from_config(
        cls, config, lock_flags: dict | None = None, max_num_patches: int | None = None, named: str = "the model"
    ) -> "ModelShape":
        """The shape of a model of `config` (a loaded CLIPConfig, SiglipConfig or Siglip2Config): parameters counted
        exactly on the meta device, and those that train with the towers `lock_flags` locks ({name: value} of the
        train flags, plan.trainable.LOCK_ARGUMENTS), once they are found to fit the config (else PlanConfigError).
        SigLIP 2 (NaFlex) sees `max_num_patches` patches per image (default: its whole grid), padded to it."""
        import torch

        from disco_clip_ds.models.configs import plain_model_class

        model_type = config.model_type
        flags = SimpleNamespace(**(lock_flags or {}))
        problem = lock_problem(flags, config)
        if problem:
            raise PlanConfigError(problem)
        locks = tower_locks(flags)
        with torch.device("meta"), zero3_init_paused():  # a live ZeRO-3 config would partition it
            model = plain_model_class(model_type)(config)
        numels = [p.numel() for p in model.parameters()]
        trained = trainable_numels(model, locks)
        v, t = config.vision_config, config.text_config
        # CLIP's vision tower adds a class token; SigLIP's pools the patches with an attention head instead.
        if model_type == "siglip2":
            patches = _naflex_patches(v, max_num_patches)
            image = (1, patches, v.num_channels * v.patch_size**2)
        elif max_num_patches is not None:
            raise PlanConfigError(f"--max_num_patches is SigLIP 2's (NaFlex); {named} is a {model_type} model")
        else:
            patches = (v.image_size // v.patch_size) ** 2
            image = (v.num_channels, v.image_size, v.image_size)
        embed_dim = embedding_width(config)
        towers = {
            "vision": {
                "layers": v.num_hidden_layers,
                "tokens": patches + (model_type == "clip"),
                "hidden": v.hidden_size,
                "mlp": v.intermediate_size,
                "patches": patches,
                "patch_pixels": v.num_channels * v.patch_size**2,
            },
            "text": {
                "layers": t.num_hidden_layers,
                "tokens": t.max_position_embeddings,
                "hidden": t.hidden_size,
                "mlp": t.intermediate_size,
            },
        }
        return cls(
            towers,
            image,
            t.max_position_embeddings,
            embed_dim,
            sum(numels),
            max(numels),
            LOSS_FAMILIES[model_type],
            trainable=sum(trained),
            largest_trainable=max(trained, default=0),
        )

    @property
    def patches(self) -> int:
        """The image tower's patches per image (SigLIP 2: its NaFlex budget)."""
        return self.towers["vision"]["patches"]

    def check_impl(self, impl: str) -> None:
        """Refuse a loss implementation this model's loss family does not have."""
        if impl not in FAMILY_IMPLS[self.loss]:
            raise PlanConfigError(f"--loss_impl {impl}: the {self.loss} loss has {', '.join(FAMILY_IMPLS[self.loss])}")

    def with_patch_dropout(self, dropout: float) -> "ModelShape":
        """This shape trained with patch dropout `dropout`: the image tower's layers see the kept patches (and the
        class token) only; its embeddings still see every patch."""
        return replace(self, patch_dropout=dropout)

    def layer_tokens(self, tower: dict) -> int:
        """The tokens a tower's encoder layers see per sample in training."""
        if "patches" not in tower or not self.patch_dropout:
            return tower["tokens"]
        from disco_clip_ds.models.patch_dropout import kept_patches

        class_tokens = tower["tokens"] - tower["patches"]
        return class_tokens + kept_patches(tower["patches"], self.patch_dropout)

    def features(self) -> dict:
        """Shape sums the activation fit is linear in (see bench/plan/act_fit.py)."""
        ts, tokens = self.towers.values(), self.layer_tokens
        return {
            "layer_sh": sum(t["layers"] * tokens(t) * t["hidden"] for t in ts),
            "layer_sm": sum(t["layers"] * tokens(t) * t["mlp"] for t in ts),
            "embed_sh": sum(t["tokens"] * t["hidden"] for t in ts),
            "tower_layer_sh_sm": [(tokens(t) * t["hidden"], tokens(t) * t["mlp"]) for t in ts],
        }

    def training_flops_per_sample(self) -> dict[str, float]:
        """Each tower's training FLOPs per sample (forward and backward, 3 x the forward), counting the matrix
        products: per layer and token 4 h^2 (q, k, v, out) + 2 h m (MLP) + 2 t h (scores and values) multiply-adds
        over the tokens the layer sees, and the patch embedding over every patch."""
        flops = {}
        for name, t in self.towers.items():
            tokens, h = self.layer_tokens(t), t["hidden"]
            macs = t["layers"] * tokens * (4 * h * h + 2 * h * t["mlp"] + 2 * tokens * h)
            macs += t.get("patches", 0) * t.get("patch_pixels", 0) * h
            flops[name] = 3 * 2 * macs
        return flops

    def input_bytes(self, pixel_bytes: int) -> int:
        """One sample's inputs: pixels in the compute dtype, int64 token ids."""
        return math.prod(self.image) * pixel_bytes + self.text_tokens * 8

    @staticmethod
    def activation_elements_from(features: dict, fit: dict, checkpointing: bool) -> float:
        """Activation elements per sample from the shape sums and the fitted coefficients."""
        embed = fit["eps"] * features["embed_sh"]
        if not checkpointing:
            return fit["alpha"] * features["layer_sh"] + fit["beta"] * features["layer_sm"] + embed
        one_layer = max(fit["alpha"] * sh + fit["beta"] * sm for sh, sm in features["tower_layer_sh_sm"])
        return fit["delta"] * features["layer_sh"] + embed + one_layer

    def forward_bytes_per_sample(self, elem_bytes: int) -> float:
        """A no-grad forward (a distillation teacher's) keeps nothing for a backward: its peak is inside the MLP of
        one layer of its larger tower, where the layer's input and LayerNorm output (2 s x h) are alive beside the
        first product and the activation's temporaries (4 s x m: quick_gelu's x, 1.702 x, its sigmoid and their
        product); plus the sample's inputs. Counted, not fitted (the activation fit measures what a backward keeps);
        bench/plan/plan_check.py checks it against measured steps with a teacher."""
        live = max(self.layer_tokens(t) * (2 * t["hidden"] + 4 * t["mlp"]) for t in self.towers.values())
        return live * elem_bytes + self.input_bytes(elem_bytes)

    def activation_bytes_per_sample(self, fit: dict, checkpointing: bool, elem_bytes: int) -> float:
        return self.activation_elements_from(self.features(), fit, checkpointing) * elem_bytes + self.input_bytes(
            elem_bytes
        )


def embedding_width(config) -> int:
    """The width of a CLIPConfig's or SiglipConfig's embeddings (what a teacher stores per image and caption)."""
    return config.projection_dim if config.model_type == "clip" else config.text_config.projection_size


def load_fit(path=FIT_FILE) -> dict:
    """The fitted activation coefficients (alpha, beta, eps, delta)."""
    try:
        return json.loads(Path(path).read_text())["coefficients"]
    except (OSError, KeyError, ValueError) as e:
        raise PlanConfigError(
            f"activation fit {path} unreadable ({e}); regenerate it with: python bench/plan/act_fit.py"
        ) from None


@dataclass
class Settings:
    """The validated numbers of a DeepSpeed config for one world size."""

    world: int
    micro_batch: int
    grad_accum: int
    train_batch: int
    stage: int
    precision: str
    comm_bytes: int
    reduce_bucket: int = 500_000_000
    allgather_bucket: int = 500_000_000
    overlap_comm: bool = False
    bucket_allreduce: bool = True  # zero_optimization.use_multi_rank_bucket_allreduce (DeepSpeed's default: on)
    prefetch_bucket: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    offload_optimizer: bool = False
    offload_param: bool = False
    trainer_auto: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    contrastive_accumulation: bool = True  # the trainer's --contrastive_accumulation
    ema: bool = False  # the trainer's --ema_decay is set: an fp32 EMA of the trainable weights

    @property
    def contrastive_steps(self) -> int:
        """Micro-steps whose pairs one contrastive loss spans: K under contrastive accumulation, else 1."""
        return self.grad_accum if self.contrastive_accumulation else 1

    @property
    def contrastive_batch(self) -> int:
        return self.micro_batch * self.world * self.contrastive_steps


def model_state_bytes(
    params: int,
    largest: int,
    stage: int,
    precision: str,
    world: int,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    trainable: int | None = None,
) -> dict:
    """Parameters, gradients and optimizer (Adam) states per GPU.

    Mixed precision (bf16/fp16), per parameter: 2 B 16-bit weights, 2 B 16-bit gradients, 4 B fp32 gradient
    partition, 12 B fp32 master weights + Adam m and v. ZeRO-1 partitions the fp32 parts, ZeRO-2 also the
    16-bit gradients, ZeRO-3 also the 16-bit weights (plus the largest layer gathered). For stages 2 and 3 the
    total is DeepSpeed's own estimate_zero{2,3}_model_states_mem_needs (2P + 18P/N; 4*largest + 18P/N, less
    what CPU offload moves off the GPU). fp32 training: 4 B weights, 4 B gradients, 8 B Adam states,
    partitioned the same way. Frozen parameters (locked towers) have their weights only: gradients, fp32 copies
    and optimizer states are counted for the `trainable` ones (None: all `params`).
    """
    n, t = world, params if trainable is None else trainable
    weights = _weight_bytes(params, largest, stage, precision, n, offload_param)
    if precision == "fp32":
        grads = 4 * t / n if stage >= 2 else 4 * t
        optim = 0.0 if offload_optimizer else (8 * t / n if stage >= 1 else 8 * t)
        return {"params": weights, "grads": grads, "optimizer": optim}
    optim = 0.0 if offload_optimizer else (12 * t / n if stage >= 1 else 12 * t)
    if stage in (2, 3):  # DeepSpeed's estimator is the reference total; gradients are what remains of it
        total = _deepspeed_estimate(t, largest, stage, n, offload_optimizer, offload_param)
        trained_weights = _weight_bytes(t, largest, stage, precision, n, offload_param)
        return {"params": weights, "grads": max(0.0, total - trained_weights - optim), "optimizer": optim}
    grads = 2 * t + (0.0 if offload_optimizer else (4 * t / n if stage == 1 else 4 * t))
    return {"params": weights, "grads": grads, "optimizer": optim}


def _weight_bytes(params: int, largest: int, stage: int, precision: str, world: int, offload_param: bool) -> float:
    """The training-dtype weights per GPU: all of them, ZeRO-3's partition plus the largest gathered."""
    if precision == "fp32":
        return 4 * params / world + 4 * largest if stage == 3 else 4 * params
    if offload_param:
        return 4 * largest
    return 2 * params / world + 4 * largest if stage == 3 else 2 * params


def _deepspeed_estimate(
    params: int, largest: int, stage: int, world: int, offload_optimizer: bool, offload_param: bool
) -> int:
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        return estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=world, cpu_offload=offload_optimizer)[1]
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    return estimate_zero3_model_states_mem_needs(
        params, largest, num_gpus_per_node=world, cpu_offload=offload_optimizer, cpu_offload_params=offload_param
    )[1]


def zero_buffer_bytes(settings: Settings) -> float:
    """ZeRO's communication buckets. DeepSpeed allocates them at their configured size whatever the model's
    (ZeRO-1/2 reduce buffers, doubled with overlap_comm); its docs budget 4.5x the allgather_bucket_size and
    reduce_bucket_size values with overlap_comm, which is what is counted here. ZeRO-3: the prefetch and
    reduce buckets."""
    e = PRECISION_BYTES[settings.precision]
    if settings.stage == 0:
        return 0.0
    if settings.stage == 3:
        return settings.prefetch_bucket * e + settings.reduce_bucket * settings.comm_bytes
    buckets = settings.reduce_bucket * settings.comm_bytes + settings.allgather_bucket * e
    return buckets * (4.5 if settings.overlap_comm else 1.0)


def loss_bytes(
    impl: str, batch: int, world: int, dim: int, elem: int, chunk_size: int | None = None, loss: str = "softmax"
) -> float:
    """Peak working set of the loss on one rank: global batch `batch`, local rows b = batch/world.

    Counted from the code (disco_clip_ds/losses for disco and tiled, the models' own losses for local) and checked
    against measured peaks (tests/test_plan.py). G = one modality's gathered features, B x d x elem;
    rows = chunk_size or the loss's own default_chunk_size, at most b.
    softmax (CLIP):
      local (per-device loss over this rank's b pairs): b x b logits, the two log-softmax outputs autograd keeps
        and their gradients, counted in fp32 (an upper bound under 16-bit training): 4 b^2 fp32 at peak, plus
        both modalities' local features (2 x b x d).
      disco: per direction a b x B similarity block and its scaled logits (both kept by autograd), in backward
        their gradients and the softmax: 7 b x B fp32, plus 2 G, their gradients (2 G) and fp32 copies of bf16 keys.
      tiled (one block): G (texts only), their fp32 gradient (B x d) built in backward, an fp32 copy of bf16
        texts, four tile-sized fp32 buffers of rows x B (the logits, their exponentials and the temporaries of the
        reductions and gradient matmuls; with the default keep_bytes a kept block is one tile), the fp32 image
        gradient (b x d) and both local modalities' gradients (2 x b x d).
    sigmoid (SigLIP), tiled (the ring): no term grows with the world size. Two text blocks in flight (b x d x elem
      each) and the fp32 copy of the one computed on, the block's fp32 gradient and the one arriving (2 b x d
      fp32), the fp32 image gradient and images (b x d each, the copy only for 16-bit), three tile-sized fp32
      buffers of rows x b (dot products, sigmoid gradient, a matmul temporary) and both local gradients. local:
      as CLIP's (b x b logits, log-sigmoid and their gradients).
    """
    from disco_clip_ds.losses import default_chunk_size
    from disco_clip_ds.losses.sigmoid import default_chunk_size as sigmoid_chunk_size

    b = batch / world
    if loss == "sigmoid":
        if impl == "local":
            return 2 * b * dim * elem + 4 * b * b * 4
        if impl == "tiled":
            rows = min(chunk_size or sigmoid_chunk_size(math.ceil(b)), b)
            copies = 2 * b * dim * 4 if elem != 4 else 0  # fp32 copies of the computed block and of the images
            return 2 * b * dim * elem + copies + 3 * b * dim * 4 + 3 * rows * b * 4 + 2 * b * dim * elem
        raise PlanConfigError(f"--loss_impl {impl}: the sigmoid loss has {', '.join(FAMILY_IMPLS['sigmoid'])}")
    gathered = batch * dim * elem
    fp32_keys = batch * dim * 4 if elem != 4 else 0
    rows = min(chunk_size or default_chunk_size(batch), b)
    if impl == "local":
        return 2 * b * dim * elem + 4 * b * b * 4
    if impl == "disco":
        return 4 * gathered + 2 * fp32_keys + 7 * b * batch * 4
    if impl == "tiled":
        return gathered + batch * dim * 4 + fp32_keys + 4 * rows * batch * 4 + b * dim * (4 + 2 * elem)
    raise PlanConfigError(f"--loss_impl must be one of {LOSS_IMPLS}, got {impl!r}")


@dataclass
class MemoryPlan:
    terms: dict  # name -> bytes per GPU
    total: float
    capacity: float

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def memory_plan(
    shape: ModelShape,
    settings: Settings,
    fit: dict,
    impl: str,
    checkpointing: bool,
    capacity: float,
    overhead: float = DEFAULT_OVERHEAD_GB * GiB,
    micro_batch: int | None = None,
    chunk_size: int | None = None,
    teacher: ModelShape | None = None,
) -> MemoryPlan:
    """Per-GPU memory of one training step (bytes), term by term; with a distillation `teacher` (`--teacher`), its
    frozen weights, its forward and its embeddings too."""
    micro = settings.micro_batch if micro_batch is None else micro_batch
    elem = PRECISION_BYTES[settings.precision]
    # the local loss contrasts each micro-batch alone: the trainer accumulates it plainly, never contrastively
    k = 1 if impl == "local" else settings.contrastive_steps
    terms = model_state_bytes(
        shape.params,
        shape.largest_param,
        settings.stage,
        settings.precision,
        settings.world,
        settings.offload_optimizer,
        settings.offload_param,
        shape.trainable,
    )
    terms["zero buffers"] = zero_buffer_bytes(settings)
    terms["activations"] = shape.activation_bytes_per_sample(fit, checkpointing, elem) * micro
    if k == 1:
        terms[f"loss ({impl})"] = loss_bytes(
            impl, micro * settings.world, settings.world, shape.projection_dim, elem, chunk_size, shape.loss
        )
    else:
        # The loss over all micro x world x K pairs runs on the cached embeddings in fp32, between the no-grad and
        # the grad passes (counted on top of the activations all the same: an upper bound). The cache: K x micro
        # image and text embeddings per rank in the training dtype plus their fp32 gradients, kept until replay.
        terms[f"loss ({impl})"] = loss_bytes(
            impl, micro * settings.world * k, settings.world, shape.projection_dim, 4, chunk_size, shape.loss
        )
        terms["cached embeddings"] = 2 * k * micro * shape.projection_dim * (elem + 4)
    if teacher is not None:
        # Its weights in the training dtype, partitioned under ZeRO-3 (its own inference engine), else whole; no
        # gradients, no optimizer state. Its no-grad forward runs before the student's and keeps nothing: its peak
        # counts only where it exceeds the student's activations and loss, which are not alive yet. Its fp32
        # embeddings of the step's K micro-batches, and the loss's gather of every rank's teacher texts (B x d').
        shards = settings.world if settings.stage == 3 else 1
        terms["teacher weights"] = teacher.params * elem / shards
        student_peak = terms["activations"] + terms[f"loss ({impl})"]
        terms["teacher forward"] = max(0.0, teacher.forward_bytes_per_sample(elem) * micro - student_peak)
        terms["teacher embeddings"] = (2 * k * micro + micro * settings.world * k) * teacher.projection_dim * 4
    if settings.ema:  # train/ema.py: fp32, partitioned like the fp32 master weights (ZeRO-1/2/3), else whole
        terms["ema"] = 4 * shape.trainable / (settings.world if settings.stage >= 1 else 1)
    # A parameter's gradient is produced whole before it is added to its buffer (the token embedding's is dense).
    terms["transient grad"] = shape.largest_trainable * elem
    terms["framework"] = overhead
    return MemoryPlan(terms, sum(terms.values()), capacity)


def max_micro_batch(
    shape, settings, fit, impl, checkpointing, capacity, overhead, chunk_size=None, teacher=None
) -> int:
    """Largest per-GPU batch whose plan fits (0 if even 1 does not); memory grows monotonically with batch."""
    fits = lambda b: (
        memory_plan(shape, settings, fit, impl, checkpointing, capacity, overhead, b, chunk_size, teacher).fits
    )
    return _largest(fits)


def max_contrastive_steps(
    shape, settings, fit, impl, checkpointing, capacity, overhead, chunk_size=None, limit: int = 1 << 20, teacher=None
) -> int:
    """Largest K whose plan fits at the config's micro batch under contrastive accumulation (0 if K=1 does not):
    the largest contrastive batch for this GPU count is micro x world x K. For the global-batch losses only."""
    if impl == "local":
        raise PlanConfigError("--loss_impl local cannot be accumulated contrastively: plan tiled or disco")
    accumulating = lambda k: replace(settings, grad_accum=k, contrastive_accumulation=True)
    rest = (fit, impl, checkpointing, capacity, overhead, None, chunk_size, teacher)
    fits = lambda k: memory_plan(shape, accumulating(k), *rest).fits
    return _largest(fits, limit)


def _largest(fits, limit: float = math.inf) -> int:
    """Largest n in [1, limit] with fits(n), for monotone fits (doubling, then bisection); 0 if none."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _naflex_patches(vision_config, max_num_patches: int | None) -> int:
    """SigLIP 2's patch budget (default: the whole position grid): any number of patches from one, as in training
    (Siglip2 interpolates its position embeddings to each image's grid of patches)."""
    budget = vision_config.num_patches if max_num_patches is None else max_num_patches
    if budget < 1:
        raise PlanConfigError(f"--max_num_patches {budget}: give at least one patch per image")
    return budget
