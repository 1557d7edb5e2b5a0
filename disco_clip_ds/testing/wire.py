"""Bytes a rank sends through torch.distributed's collectives (ring algorithms) and point-to-point sends, counted at
the call."""

from __future__ import annotations

from typing import ClassVar


def _gathered(n, out, inp):
    return (n - 1) * inp.nelement() * inp.element_size()


def _scattered(n, out, inp):
    return (n - 1) * out.nelement() * out.element_size()


def _sent(op) -> int:
    return op.tensor.nelement() * op.tensor.element_size() if "send" in op.op.__name__ else 0


class WireBytes:
    """Counts the bytes this rank sends through torch.distributed collectives and point-to-point sends while
    active (a context manager).

    Ring algorithms (what NCCL and gloo use for large tensors): an all-gather sends (N-1) input-sized pieces, a
    reduce-scatter (N-1) output-sized pieces, an all-reduce 2 (N-1)/N of the tensor. Calls made inside a
    counted call (a deprecated name forwarding to its new one) are not counted again. `total` is the sum in
    bytes, `calls` the (function name, bytes) of each counted call.
    """

    RULES: ClassVar[dict] = {
        "all_gather_single": _gathered,
        "all_gather_into_tensor": _gathered,
        "all_gather": _gathered,
        "reduce_scatter_single": _scattered,
        "reduce_scatter_tensor": _scattered,
        "all_reduce": lambda n, t, *_: 2 * (n - 1) / n * t.nelement() * t.element_size(),
        "batch_isend_irecv": lambda n, ops, *_: sum(_sent(op) for op in ops),  # point to point: each sent tensor
    }

    def __init__(self):
        self.total, self.calls, self._saved, self._depth = 0.0, [], {}, 0

    def __enter__(self) -> WireBytes:
        import torch.distributed as dist

        for name, rule in self.RULES.items():
            if hasattr(dist, name):
                self._saved[name] = original = getattr(dist, name)
                setattr(dist, name, self._wrap(name, rule, original))
        return self

    def _wrap(self, name, rule, original):
        import torch.distributed as dist

        def counted(*args, **kwargs):
            if self._depth == 0:
                nbytes = rule(dist.get_world_size(kwargs.get("group")), *args[:2])
                self.total += nbytes
                self.calls.append((name, nbytes))
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved = {}
