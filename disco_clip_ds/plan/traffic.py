"""Bytes one rank sends per optimizer step: ZeRO's gradient and parameter collectives and the loss's.

disco all-gathers both modalities' features and reduce-scatters their gradient in backward (the DisCo paper
all-reduces there: twice the bytes); tiled moves the texts only, plus two all-reduces of B fp32 column values; local
sends nothing. The sigmoid loss (SigLIP, tiled) passes the text blocks round a ring: N - 1 blocks in forward, N - 1
again in backward with N fp32 gradient blocks, the last bringing each home. Ring collectives: a rank sends (and
receives) (N-1)/N of the buffer for all-gather and reduce-scatter, 2(N-1)/N for all-reduce.

ZeRO-1/2 reduce gradients per bucket, and DeepSpeed all-reduces every bucket that spans more than one rank's
partition while `use_multi_rank_bucket_allreduce` is on (its default): with buckets as large as ours that is the
whole gradient, twice a reduce-scatter's bytes. bench/multinode measures the bytes a rank sends against these terms.
"""

from __future__ import annotations

from disco_clip_ds.plan.memory import PRECISION_BYTES, ModelShape, Settings


def traffic_bytes(shape: ModelShape, settings: Settings, loss_impls=("disco", "tiled")) -> dict:
    """Bytes one rank sends per optimizer step (ring collectives), by collective; the loss's per impl."""
    # gradients, and ZeRO-1/2's updated partitions, are the trainable parameters'; ZeRO-3 gathers every weight
    n, p, t, accum = settings.world, shape.params, shape.trainable, settings.grad_accum
    ring = (n - 1) / n
    e = PRECISION_BYTES[settings.precision]
    g = settings.comm_bytes
    if settings.stage == 0:
        grads = {"gradient all-reduce": 2 * ring * t * g}
    elif settings.stage in (1, 2):  # gradients reduced (stage 1: at the accumulation boundary; 2: every micro-step)
        reductions = 1 if settings.stage == 1 else accum
        if settings.bucket_allreduce:
            reduced = {"gradient all-reduce (multi-rank buckets)": reductions * 2 * ring * t * g}
        else:
            reduced = {"gradient reduce-scatter": reductions * ring * t * g}
        grads = {**reduced, "parameter all-gather": ring * t * e}
    else:  # weights gathered for forward and again for backward in every micro-step (and for the no-grad pass)
        gathers = 3 if settings.contrastive_steps > 1 else 2
        grads = {
            "gradient reduce-scatter": accum * ring * t * g,
            "parameter all-gather": accum * gathers * ring * p * e,
        }
    # contrastive accumulation gathers all K micro-batches' fp32 embeddings at once: the same rows, fp32 bytes
    feature_bytes = 4 if settings.contrastive_steps > 1 else e
    batch = settings.micro_batch * n
    modality = accum * ring * batch * shape.projection_dim * feature_bytes  # one modality's rows
    block = accum * settings.micro_batch * shape.projection_dim  # one rank's rows, elements
    if shape.loss == "sigmoid":
        loss = {
            "local": {},
            "tiled": {
                "sigmoid loss: text ring (forward)": (n - 1) * block * feature_bytes,
                "sigmoid loss: text ring (backward)": (n - 1) * block * feature_bytes,
                "sigmoid loss: fp32 gradient ring (backward)": n * block * 4 if n > 1 else 0,
            },
        }
        return {**grads, **{k: v for impl in loss_impls for k, v in loss[impl].items()}}
    loss = {
        "local": {},  # each rank's own pairs: nothing to send
        "disco": {
            "disco loss: feature all-gather (forward)": 2 * modality,
            "disco loss: feature reduce-scatter (backward)": 2 * modality,
            "(paper: feature all-reduce in backward)": 4 * modality,
        },
        "tiled": {
            "tiled loss: text all-gather (forward)": modality,
            "tiled loss: column lse all-reduces (forward)": accum * 2 * 2 * ring * batch * 4,
            "tiled loss: text reduce-scatter (backward)": modality,
        },
    }
    return {**grads, **{k: v for impl in loss_impls for k, v in loss[impl].items()}}
