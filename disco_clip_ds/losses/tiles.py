"""How a rank walks its share of the B x B logits: in tiles of rows (softmax, distill), or against one rank's text
block at a time passed round the ring (sigmoid, sigmoid distill). Also the option checks and the scalar handling
every loss shares. Torch only; the collectives are in comm.py.

A tile holds about DEFAULT_TILE_ELEMENTS fp32 logits unless the caller sets `chunk_size` (rows per tile).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from disco_clip_ds.losses.comm import rank_and_world, ring_exchange

# Logits per tile (rows x columns, fp32) when chunk_size is None: 2M -> 8 MiB. On CPU, tiles of a few hundred rows
# beat the plain b x B block (bench/loss); much smaller tiles make the matmuls inefficient.
DEFAULT_TILE_ELEMENTS = 1 << 21


def tile_rows(columns: int) -> int:
    """Rows per tile so that one tile against `columns` columns holds about DEFAULT_TILE_ELEMENTS fp32 values."""
    return max(32, DEFAULT_TILE_ELEMENTS // max(1, columns) // 8 * 8)


def tiles(rows: int, chunk: int) -> Iterator[slice]:
    """The row slices of tiles of `chunk` rows over `rows` rows (the last one may be shorter)."""
    return (slice(start, start + chunk) for start in range(0, rows, chunk))


def check_options(chunk_size, distill_weight: float = 1.0) -> None:
    """The options every loss shares, refused when a loss (or its module) is built and again when called."""
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows or None, got {chunk_size}")
    if not 0 <= distill_weight <= 1:
        raise ValueError(f"distill_weight must lie in [0, 1] (1: distillation alone), got {distill_weight}")


def as_scalar(value):
    """A one-element tensor as a 0-dim one (SiglipModel's logit_scale and logit_bias have shape (1,)); anything
    else unchanged, for check_inputs to judge."""
    return value.reshape(()) if torch.is_tensor(value) and value.numel() == 1 else value


def as_fp32(value, device) -> torch.Tensor:
    """A scalar loss argument (0-dim tensor or number) as a 0-dim fp32 tensor on `device`, kept on the device: the
    loss computes with it there rather than reading it to the host (a host sync per call)."""
    return torch.as_tensor(value, device=device).float()


def add_tile_gradient(grad, rows, q, q_scaled, texts32, scale, grad_i, grad_t, grad_s) -> None:
    """Given G = dL/dS for a tile of rows against all B columns, S = (s Q) T^T: add s G T to grad_i's rows,
    G^T (s Q) to grad_t and sum_ij G_ij q_i.t_j = dL/ds to grad_s. A gradient passed as None is not wanted."""
    if grad_i is not None or grad_s is not None:
        grad_q = grad @ texts32  # d/dq_i = s * grad_q_i; d/ds = sum_ij G_ij q_i.t_j = q . grad_q
        if grad_s is not None:
            grad_s += torch.vdot(q.reshape(-1), grad_q.view(-1))
        if grad_i is not None:
            grad_i[rows] = grad_q.mul_(scale)
    if grad_t is not None:
        grad_t.addmm_(grad.T, q_scaled)  # s G^T q: the scale applied as addmm's alpha would apply it


def add_ring_tile_gradient(grad, rows, q, dots, block32, scale, grad_i, block_grad, scale_bias_grads) -> None:
    """Given G = dL/du for a tile of rows against one text block K, u = s Q K^T + t (dots = Q K^T): add s G K to
    grad_i's rows, s G^T Q to the block's gradient and sum(G * dots), sum(G) to dL/ds, dL/dt."""
    scale_bias_grads[0] += torch.vdot(grad.reshape(-1), dots.reshape(-1))
    scale_bias_grads[1] += grad.sum()
    grad_i[rows].addmm_(grad, block32 * scale)  # the scale applied as addmm's alpha would apply it
    block_grad.addmm_(grad.T, q * scale)


class Ring:
    """The ring walk of a rank's image rows against every rank's text block(s), the blocks passing from rank to rank
    (rank r computes on its own block first, then on r - 1's, ...), so that a rank never holds more than two copies
    of each block whatever the number of ranks.

    `blocks`: this rank's blocks (the student's texts, and the teacher's for distillation), each travelling in its
    own dtype and computed on in fp32. In backward, `grad` (the fp32 gradient of the first block, which the caller
    accumulates into while the block is computed on) follows its block to the next rank after each step; the last
    step brings it home, so that after the walk it holds the gradient of this rank's texts.
    """

    def __init__(self, sizes: list[int], group, chunk: int, *blocks: torch.Tensor):
        self.sizes, self.group, self.chunk, self.blocks = sizes, group, chunk, blocks
        self.rank, self.world = rank_and_world(group)
        self.grad: torch.Tensor | None = None

    def walk(self, images32: torch.Tensor, backward: bool = False) -> Iterator[tuple]:
        """Yield (own, rows, fp32 blocks) for every tile of rows of `images32` against every rank's blocks; `own`:
        the blocks are this rank's (the first step), whose diagonal from rows.start holds the positive pairs."""
        blocks = tuple(b.detach() for b in self.blocks)
        for k in range(self.world):
            nxt_src = (self.rank - k - 1) % self.world
            nxt, pending = None, []
            if k < self.world - 1:  # the next blocks travel while these are computed
                nxt = tuple(b.new_empty((self.sizes[nxt_src], b.shape[1])) for b in blocks)
                for tag, (send, recv) in zip((0, 2), zip(blocks, nxt)):
                    pending += ring_exchange(send, recv, self.group, tag=tag)
            blocks32 = tuple(b.float() for b in blocks)
            for rows in tiles(images32.shape[0], self.chunk):
                yield k == 0, rows, blocks32
            if backward and self.world > 1:  # the gradient follows its block; the last step brings it home
                arrived = self.grad.new_empty((self.sizes[nxt_src], self.grad.shape[1]))
                for work in ring_exchange(self.grad, arrived, self.group, tag=1):
                    work.wait()
                self.grad = arrived
            for work in pending:
                work.wait()
            if nxt is not None:
                blocks = nxt
