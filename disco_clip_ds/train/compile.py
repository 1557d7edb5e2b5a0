"""`--torch_compile`: the two encoders compiled, the global-batch loss left eager.

The Trainer's own `--torch_compile` wraps the whole model (accelerate's `torch.compile(model)`, or DeepSpeed's
`engine.compile()`), which would trace the loss's collectives into the graph and put `_orig_mod.` in front of every
state-dict key. Instead `take_compile_settings` takes the three flags out of the arguments before the Trainer reads
them, and `compile_towers` compiles each tower's `forward` in place (`torch.compile(tower.forward)` on the
instance): parameter names, state dicts, checkpoints, `save_pretrained` and export stay those of the eager model,
and the tower's own hooks still run in `__call__`. The loss (`disco_clip_ds.losses`) runs eager between the towers'
graphs: its collectives are the graphs' edges.

What cannot be compiled runs eager after one line saying why, never a traceback:
  - a model whose parameters ZeRO-3 partitions, or one FSDP shards (`why_not_compiled`): their parameter hooks
    gather and free the weights around every module's forward, which dynamo does not trace under these engines on
    CPU ranks (docs/training.md, "torch.compile");
  - a tower whose compile fails at its first call, or at a later recompile (no C++ compiler, an inductor error): the
    failed call is run again eager, and the tower stays eager from then on (`GuardedTower`). The backward graph is
    compiled together with the forward (`force_non_lazy_backward_lowering`), so that its failure too happens inside
    the guarded call and not in the middle of the engine's backward.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger("disco_clip_ds.train")

TOWERS = {"vision_model": "vision tower", "text_model": "text tower"}


@dataclass(frozen=True)
class CompileSettings:
    """How to compile the towers: torch.compile's `backend` (a name, or a callable) and `mode` (None: its default)."""

    backend: str | Callable = "inductor"
    mode: str | None = None


def take_compile_settings(args) -> CompileSettings | None:
    """The run's --torch_compile settings (None without it), taken out of `args` (torch_compile False, backend and
    mode None) so that the Trainer, accelerate and DeepSpeed compile nothing themselves: they would compile the
    whole model, the loss's collectives included."""
    if not args.torch_compile:
        return None
    settings = CompileSettings(args.torch_compile_backend or "inductor", args.torch_compile_mode)
    args.torch_compile, args.torch_compile_backend, args.torch_compile_mode = False, None, None
    return settings


def why_not_compiled(model, fsdp: bool = False) -> str | None:
    """Why `model`'s towers must run eager under this run's engine, in a few words; None when they can be compiled.
    `fsdp`: the Trainer's --fsdp is set (`accelerate launch` with an FSDP config says so in its environment)."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return "DeepSpeed ZeRO-3 partitions the parameters (its gather and release hooks around every layer)"
    if fsdp or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        return "FSDP shards the parameters (its gather and release hooks around every layer)"
    return None


def compile_towers(model, settings: CompileSettings | None, fsdp: bool = False) -> list[str]:
    """Compile `model`'s vision and text towers in place with `settings` (None: leave them eager); the names of the
    towers compiled. Under ZeRO-3 or FSDP (`why_not_compiled`) both stay eager, said in one line."""
    if settings is None:
        return []
    why = why_not_compiled(model, fsdp)
    if why:
        logger.warning("--torch_compile: the towers run eager: %s", why)
        return []
    compiled = []
    for attribute, name in TOWERS.items():
        tower = getattr(model, attribute, None)
        if tower is None:
            continue
        compiled_forward = torch.compile(tower.forward, backend=settings.backend, mode=settings.mode)
        # an instance attribute: nn.Module.__call__ finds it before the class's forward; nothing is renamed
        tower.forward = GuardedTower(name, compiled_forward, eager=tower.forward)
        compiled.append(name)
    logger.info(
        "--torch_compile: the %s compiled (backend %s, mode %s); the loss runs eager",
        " and ".join(compiled),
        getattr(settings.backend, "__name__", settings.backend),
        settings.mode or "default",
    )
    return compiled


def eager_forward(tower):
    """The tower's eager forward (`tower.forward` itself when it is not compiled)."""
    forward = tower.forward
    return forward.eager if isinstance(forward, GuardedTower) else forward


class GuardedTower:
    """A tower's forward: the compiled one until a compile fails, then, after one line saying why, the eager one."""

    def __init__(self, name: str, compiled, eager):
        self.name, self.compiled, self.eager = name, compiled, eager

    @property
    def is_compiled(self) -> bool:
        """False once a compile failed and the tower runs eager."""
        return self.compiled is not None

    def __call__(self, *args, **kwargs):
        if self.compiled is not None:
            try:
                # the backward graph is compiled now, with the forward, not lazily inside the engine's backward
                with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                    return self.compiled(*args, **kwargs)
            except _compile_errors() as error:
                logger.warning("--torch_compile: the %s runs eager: %s", self.name, one_line(error))
                self.compiled = None
        return self.eager(*args, **kwargs)


def _compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed compile raises: dynamo's errors (a backend's failure is wrapped in BackendCompilerFailed) and
    inductor's. An error of the model itself (a wrong shape) is neither: it is raised again by the eager run."""
    from torch._dynamo.exc import BackendCompilerFailed, InternalTorchDynamoError, Unsupported

    errors = [BackendCompilerFailed, InternalTorchDynamoError, Unsupported]
    try:
        from torch._inductor.exc import InductorError

        errors.append(InductorError)
    except ImportError:  # torch < 2.7 raises inductor's errors wrapped in BackendCompilerFailed alone
        pass
    return tuple(errors)


def one_line(error: BaseException) -> str:
    """The error's innermost cause, as `Type: first line of its message` (dynamo's BackendCompilerFailed keeps the
    backend's own error as `inner_exception`)."""
    seen = {id(error)}
    while True:
        inner = getattr(error, "inner_exception", None) or error.__cause__
        if inner is None or id(inner) in seen:
            break
        seen.add(id(inner))
        error = inner
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]
