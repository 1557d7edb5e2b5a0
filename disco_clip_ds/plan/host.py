"""Host memory per node of a training run: what its ranks, their DataLoader workers, the workers' embedding stores
and shuffle buffers, and the batches in flight hold in the node's RAM, against the node's memory.

Per node, with R ranks on the node, W DataLoader workers per rank, P the prefetch factor:

    processes         R x PROCESS_BASELINE                (python + torch + transformers + deepspeed imported)
    model states      DeepSpeed's own host estimate per node (estimate_zero2/3_model_states_mem_needs' cpu_mem:
                      the fp32 weights each rank loads, and the optimizer states under CPU offload)
    live teachers     R x 4 x teacher parameters          (a --teacher that runs: its fp32 weights, loaded on host)
    workers           R x W x WORKER_BASELINE             (a forked worker's own pages: decode buffers, copies)
    embedding stores  R x W x store_memory_bound(S, row)  (data/embeddings.py: the most one worker's EmbeddingStore
                                                           holds for S mixed sources of stored rows of `row` bytes)
    shuffle buffers   R x W x S x shuffle_buffer x sample (the block shuffle holds `shuffle_buffer` raw, encoded
                                                           samples per source: data/streams/shards.py, data/mix.py)
    batches in flight R x W x P x size                    (uint8 images, token ids and mask, stored targets: each
                                                           batch handed over is held once, in shared memory, or once
                                                           pinned (with pin_memory) in torch's caching host allocator,
                                                           whose blocks are a power of two: size = 2^ceil(log2 batch);
                                                           size = batch without pin_memory; W = 0: one, P = 1)
    batches built     R x W x batch                       (the batch each worker is collating)

The two baselines are round allowances, stated in every report; bench/scale measures a process's and a worker's
peak RSS against them (bench/scale/README.md).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

from disco_clip_ds.errors import PlanConfigError
from disco_clip_ds.plan.memory import GiB, ModelShape, Settings
from disco_clip_ds.plan.storage import DTYPE_BYTES

MiB = 2**20
PROCESS_BASELINE = 600 * MiB  # a rank's interpreter with torch, transformers and deepspeed imported, rounded up
WORKER_BASELINE = 256 * MiB  # a DataLoader worker's own pages beyond its store and buffers (fork shares the rest)
DEFAULT_SAMPLE_BYTES = 40_000  # a raw sample as img2dataset writes it at 256 px (JPEG + caption + json)
TOKEN_BYTES = 2 * 8  # input_ids and attention_mask, int64 each


@dataclass(frozen=True)
class HostSettings:
    """The facts of a run that host memory depends on (see the module's formula). `ranks_per_node` R, `workers` W
    (--dataloader_num_workers; 0 reads in the rank itself, counted as one reader without a worker's baseline),
    `prefetch_factor` P, `pin_memory`, `shuffle_buffer` and `sources` S (mixture sources: one shuffle buffer each),
    `sample_bytes` (a raw sample's encoded bytes), `stored_row_bytes` (a sample's row in the sidecars, 0 without
    --teacher_embeddings), `target_width` (the teachers' summed widths carried per sample, 0 without), and the
    micro batch's `image_elements` (channels x height x width) at `pixel_bytes` each (1: the workers hand over
    uint8, as on a GPU; 4: float32, normalised in the workers) and `text_length`."""

    ranks_per_node: int
    workers: int
    micro_batch: int
    image_elements: int
    text_length: int = 77
    pixel_bytes: int = 1
    prefetch_factor: int = 2
    pin_memory: bool = True
    shuffle_buffer: int = 1000
    sources: int = 1
    sample_bytes: int = DEFAULT_SAMPLE_BYTES
    stored_row_bytes: int = 0
    target_width: int = 0

    def batch_bytes(self) -> int:
        """One micro-batch as a worker hands it over: uint8 pixels, token ids and mask, fp32 targets (image, text)."""
        per_sample = self.pixel_bytes * self.image_elements + TOKEN_BYTES * self.text_length + 2 * 4 * self.target_width
        return self.micro_batch * per_sample


@dataclass(frozen=True)
class HostPlan:
    """Host bytes per node by term (`terms`), their `total`, the node's memory (`node_bytes`, None: not compared),
    and the store bound one worker's EmbeddingStore keeps (`store_per_worker`)."""

    terms: dict
    total: float
    node_bytes: float | None
    store_per_worker: int

    @property
    def fits(self) -> bool | None:
        return None if self.node_bytes is None else self.total <= self.node_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "fits": self.fits}


def model_state_host_bytes(
    params: int,
    largest: int,
    stage: int,
    world: int,
    ranks_per_node: int,
    offload_optimizer: bool = False,
    offload_param: bool = False,
) -> int:
    """DeepSpeed's host-memory estimate per node for the model states (`cpu_mem` of its ZeRO-2/3 estimators; the
    ZeRO-2 one for stages 0 and 1, which load the same fp32 weights on every rank)."""
    nodes = max(1, world // ranks_per_node)
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        return estimate_zero3_model_states_mem_needs(
            params,
            largest,
            num_gpus_per_node=ranks_per_node,
            num_nodes=nodes,
            cpu_offload=offload_optimizer,
            cpu_offload_params=offload_param,
        )[0]
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    return estimate_zero2_model_states_mem_needs(
        params, num_gpus_per_node=ranks_per_node, num_nodes=nodes, cpu_offload=offload_optimizer
    )[0]


def store_bound(sources: int, row_bytes: int) -> int:
    """The most host bytes one DataLoader worker's EmbeddingStore holds (data/embeddings.py's own bound); 0 without
    stored embeddings."""
    if row_bytes <= 0:
        return 0
    from disco_clip_ds.data.embeddings import store_memory_bound

    return store_memory_bound(sources, row_bytes)


def host_memory_plan(
    host: HostSettings, model_states: float, live_teacher_params: int = 0, node_bytes: float | None = None
) -> HostPlan:
    """The host memory per node of `host`'s run, term by term (the module's formula), with `model_states` the
    per-node model-state bytes (`model_state_host_bytes`) and `live_teacher_params` the parameters of the teachers
    that run live (0 with stored embeddings read instead); compared with `node_bytes` when given."""
    ranks, readers = host.ranks_per_node, host.ranks_per_node * max(1, host.workers)
    store = store_bound(host.sources, host.stored_row_bytes)
    batch = host.batch_bytes()
    held = _power_of_two(batch) if host.pin_memory else batch
    prefetched = host.prefetch_factor if host.workers else 1
    terms = {
        "processes": ranks * PROCESS_BASELINE,
        "model states": float(model_states),
        "live teachers": ranks * 4 * live_teacher_params,
        "workers": host.ranks_per_node * host.workers * WORKER_BASELINE,
        "embedding stores": readers * store,
        "shuffle buffers": readers * host.sources * host.shuffle_buffer * host.sample_bytes,
        "batches in flight": readers * prefetched * held,
        "batches built": readers * batch,
    }
    return HostPlan(terms, float(sum(terms.values())), node_bytes, store)


@dataclass(frozen=True)
class HostOptions:
    """`disco-clip plan`'s host-memory flags (commands/plan.py), each as `disco-clip train` names it where it has
    one. `gpus_per_node` None: min(--gpus, 8); `node_memory_gb` None: not compared; `teacher_embeddings`: the
    teachers' stored embeddings are read (`augmentations` K, `caption_keys` C, `embedding_dtype`, `teacher_widths`
    as `data embed` stored them; widths default to the --teacher's projection width) instead of a live teacher."""

    gpus_per_node: int | None = None
    node_memory_gb: float | None = None
    workers: int = 2
    prefetch_factor: int = 2
    pin_memory: bool = True
    shuffle_buffer: int = 1000
    sources: int = 1
    sample_bytes: int = DEFAULT_SAMPLE_BYTES
    teacher_embeddings: bool = False
    augmentations: int = 0
    caption_keys: int = 1
    embedding_dtype: str = "float32"
    teacher_widths: tuple[int, ...] = ()

    def problems(self, world: int) -> list[str]:
        """What is wrong with these options for `world` ranks, one line each with its fix."""
        counts = {
            "--dataloader_num_workers": (self.workers, 0),
            "--dataloader_prefetch_factor": (self.prefetch_factor, 1),
            "--shuffle_buffer": (self.shuffle_buffer, 0),
            "--train_sources": (self.sources, 1),
            "--sample_bytes": (self.sample_bytes, 1),
            "--augmentations": (self.augmentations, 0),
            "--caption_keys": (self.caption_keys, 1),
        }
        found = [f"{flag} {value}: give a whole number of at least {least}" for flag, (value, least) in counts.items()]
        found = [line for line, (value, least) in zip(found, counts.values()) if value < least]
        ranks = self.gpus_per_node
        if ranks is not None and not (1 <= ranks <= world and world % ranks == 0):
            found.append(f"--gpus_per_node {ranks}: give a divisor of --gpus {world} (the ranks on one node)")
        memory = self.node_memory_gb
        if memory is not None and not (math.isfinite(memory) and memory > 0):
            found.append(f"--node_memory_gb {memory:g}: give a node's memory in GiB, finite and more than 0")
        if self.teacher_embeddings and self.embedding_dtype not in DTYPE_BYTES:
            found.append(f"--embedding_dtype {self.embedding_dtype}: give one of {', '.join(DTYPE_BYTES)}")
        if any(w < 1 for w in self.teacher_widths):
            found.append(f"--teacher_widths {list(self.teacher_widths)}: give each teacher's embedding width, >= 1")
        return found


def plan_host(shape: ModelShape, settings: Settings, teacher: ModelShape | None, options: HostOptions) -> dict:
    """The host-memory part of `disco-clip plan` for a model of `shape` under `settings` (and a --teacher's
    `teacher`): {"settings": HostSettings as a dict, "plan": HostPlan as a dict}; a PlanConfigError listing every
    bad option."""
    problems = options.problems(settings.world)
    widths = list(options.teacher_widths or ([teacher.projection_dim] if teacher is not None else []))
    if options.teacher_embeddings and not widths:
        problems.append("--teacher_embeddings: give --teacher (its width is its projection) or --teacher_widths")
    if problems:
        raise PlanConfigError("; ".join(problems))
    ranks = options.gpus_per_node or min(settings.world, 8)
    row = 0
    if options.teacher_embeddings:
        from disco_clip_ds.data.embeddings import stored_row_bytes

        row = stored_row_bytes(widths, options.augmentations, options.caption_keys, options.embedding_dtype)
    host = HostSettings(
        ranks_per_node=ranks,
        workers=options.workers,
        micro_batch=settings.micro_batch,
        image_elements=math.prod(shape.image),
        text_length=shape.text_tokens,
        prefetch_factor=options.prefetch_factor,
        pin_memory=options.pin_memory,
        shuffle_buffer=options.shuffle_buffer,
        sources=options.sources,
        sample_bytes=options.sample_bytes,
        stored_row_bytes=row,
        target_width=sum(widths) if options.teacher_embeddings else 0,
    )
    live = teacher.params if teacher is not None and not options.teacher_embeddings else 0
    node = options.node_memory_gb * GiB if options.node_memory_gb is not None else None
    states = model_state_host_bytes(
        shape.params,
        shape.largest_param,
        settings.stage,
        settings.world,
        ranks,
        settings.offload_optimizer,
        settings.offload_param,
    )
    return {"settings": asdict(host), "plan": host_memory_plan(host, states, live, node).as_dict()}


def _power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def node_memory_bytes() -> int:
    """This machine's memory: MemTotal of /proc/meminfo (else the physical pages os.sysconf counts)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _fmt(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= 0.1 * GiB else f"{nbytes / MiB:.1f} MiB"


def host_warning(plan: dict) -> str | None:
    """The one line that says a plan's host memory (`HostPlan.as_dict()`) passes the node's, and what to lower; None
    when it fits or is not compared."""
    if plan["fits"] is not False:
        return None
    terms = plan["terms"]
    largest = sorted(terms, key=terms.get, reverse=True)[:2]
    return (
        f"host memory per node {_fmt(plan['total'])} passes the node's {_fmt(plan['node_bytes'])}: the largest terms "
        "are "
        + " and ".join(f"{name} ({_fmt(terms[name])})" for name in largest)
        + "; lower --dataloader_num_workers, --shuffle_buffer or the mixed sources, or use fewer ranks per node"
    )


def format_host(host: dict) -> list[str]:
    """The report's lines of `plan_host`'s dict: each term, the total against the node's memory, and the warning
    when it passes."""
    s, plan = host["settings"], host["plan"]
    against = (
        f" of {_fmt(plan['node_bytes'])}: {'fits' if plan['fits'] else 'PASSES the node memory'}"
        if plan["node_bytes"] is not None
        else " (not compared: give --node_memory_gb)"
    )
    lines = [
        f"host memory per node ({s['ranks_per_node']} ranks x {s['workers']} DataLoader workers, {s['sources']} "
        f"source(s), shuffle buffer {s['shuffle_buffer']} x {s['sample_bytes']} B; baselines "
        f"{PROCESS_BASELINE // MiB} MiB a rank, {WORKER_BASELINE // MiB} MiB a worker, assumed):"
    ]
    lines += [f"  {name:<28}{_fmt(value):>14}" for name, value in plan["terms"].items()]
    lines.append(f"  {'total':<28}{_fmt(plan['total']):>14}{against}")
    warning = host_warning(plan)
    return lines + ([f"warning: {warning}"] if warning else [])
