"""The torch internals ampguard relies on, and the check that they are still there.

torch's public API cannot do some of what ampguard does (carry the loss-finite
bit on the scaler's one host read, unscale bfloat16 gradients without the CUDA
kernel, clip with torch's own grouping), so a few private names are used, and
ampguard's torch requirement is open-ended: a future torch may rename one.
Each patch declares the privates it needs (``Patch.requires_privates``, lists
of :class:`Private` below); install checks them, existence and the parameters
ampguard passes, and a patch whose privates changed is reported unavailable
with the name (``ampguard patches``) instead of failing inside a training step.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Private:
    """A torch name ampguard uses: the leading parameters and the keywords it calls it with (checked when given)."""

    path: str
    parameters: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()


GRAD_SCALER: tuple[Private, ...] = (
    Private("torch.amp.grad_scaler.OptState"),
    Private("torch.amp.grad_scaler._MultiDeviceReplicator"),
    Private("torch.amp.grad_scaler._refresh_per_optimizer_state"),
    Private("torch.amp.grad_scaler.GradScaler._maybe_opt_step", ("self", "optimizer", "optimizer_state")),
    Private(
        "torch.amp.grad_scaler.GradScaler._unscale_grads_",
        ("self", "optimizer", "inv_scale", "found_inf", "allow_fp16"),
    ),
    Private("torch.amp.grad_scaler.GradScaler._lazy_init_scale_growth_tracker", ("self", "dev")),
    Private("torch._amp_foreach_non_finite_check_and_unscale_"),
    Private("torch._amp_update_scale_"),
)

# ampguard.module_hooks: global module hooks re-armed under the keys of their first registration.
MODULE_HOOKS: tuple[Private, ...] = (
    Private("torch.nn.modules.module.register_module_forward_pre_hook"),
    Private("torch.nn.modules.module.register_module_forward_hook", keywords=("always_call",)),
    Private("torch.nn.modules.module._global_forward_pre_hooks"),
    Private("torch.nn.modules.module._global_forward_hooks"),
    Private("torch.nn.modules.module._global_forward_hooks_always_called"),
)

FP32_ISLANDS: tuple[Private, ...] = (
    *MODULE_HOOKS,
    Private("torch._foreach_copy_"),
    Private("torch.optim.Optimizer.profile_hook_step"),
)

MASTER_WEIGHTS: tuple[Private, ...] = (
    Private("torch.optim.optimizer.register_optimizer_step_pre_hook"),
    Private("torch.optim.optimizer.register_optimizer_step_post_hook"),
    Private("torch._foreach_copy_"),
    Private("torch.optim.Optimizer.profile_hook_step"),
)

CLIP_GRAD: tuple[Private, ...] = (
    Private("torch._foreach_norm"),
    Private("torch._foreach_mul_"),
)


def resolve(path: str) -> Any:
    """The object at a dotted path: the longest importable module, then attributes."""
    parts = path.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            found = getattr(found, name)
        return found
    raise ImportError(path)


def problem(privates: Iterable[Private]) -> str | None:
    """What is missing or changed among ``privates``, or None when all are as ampguard expects."""
    for private in privates:
        try:
            found = resolve(private.path)
        except (ImportError, AttributeError):
            return f"torch has no {private.path}"
        if not (private.parameters or private.keywords):
            continue
        try:
            names = tuple(inspect.signature(found).parameters)
        except (TypeError, ValueError):  # a builtin without a signature: nothing to compare
            continue
        if names[: len(private.parameters)] != private.parameters:
            return (
                f"{private.path} takes ({', '.join(names)}), ampguard calls it with ({', '.join(private.parameters)})"
            )
        missing = [keyword for keyword in private.keywords if keyword not in names]
        if missing:
            return f"{private.path} has no {', '.join(missing)} parameter"
    return None


def is_compiling() -> bool:
    """Whether torch.compile is tracing the caller: dynamo (``torch.compiler.is_compiling``; ``torch._dynamo``'s
    before 2.3), or the backend tracing the graph dynamo made (a compile in progress).

    Global module hooks return at once then: dynamo would trace them, and on torch 2.3 a hook that looks at
    modules recursed until the process aborted. torch 2.3's ``is_compiling()`` is true only where dynamo traces
    (it folds the call to a constant, and never traces the lines after it), and its graphs call ``torch.nn``
    modules (``call_module``): AOT autograd (``aot_eager``, inductor) traces them through their ``__call__``, global
    hooks and all, with functional and fake tensors, while it is false. A later torch holds it true for the whole
    compile (torch 2.14 in CI); on 2.3 dynamo's compile context (set for the whole compile, never while compiled
    code runs) tells.
    """
    check = _dynamo_check()
    if check is not None and check():
        return True
    context = _compile_context()
    return context is not None and context() is not None


_dynamo_checks: list[Callable[[], bool] | None] = []  # torch's is_compiling, once resolved


def _dynamo_check() -> Callable[[], bool] | None:
    """torch's ``is_compiling``, resolved once (every module call on a sampled or watched step asks).

    Kept in a list, not behind ``functools.cache``: dynamo traces this function
    (a global hook asks while it traces) and warns of every cached function it meets.
    """
    if not _dynamo_checks:
        import torch

        check: Callable[[], bool] | None = getattr(getattr(torch, "compiler", None), "is_compiling", None)
        if check is None:
            check = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
        _dynamo_checks.append(check)
    return _dynamo_checks[0]


def dynamo_compiling() -> Callable[[], bool]:
    """The first of :func:`is_compiling`'s checks: torch's ``is_compiling`` itself, for a caller at every forward
    pass that makes both checks itself (no frame of ampguard's per call)."""
    return _dynamo_check() or _never


def _never() -> bool:
    return False


def compile_context() -> Callable[[], Any] | None:
    """The second: dynamo's ``CompileContext.try_get`` (None until ``torch._guards`` is imported)."""
    return _compile_context()


_context_getter: list[Callable[[], Any]] = []  # dynamo's CompileContext.try_get, once torch._dynamo is imported


def _compile_context() -> Callable[[], Any] | None:
    if not _context_getter:
        guards = sys.modules.get("torch._guards")  # (imported by torch._dynamo: not there, nothing compiles)
        getter = getattr(getattr(guards, "CompileContext", None), "try_get", None)
        if getter is None:
            return None
        _context_getter.append(getter)
    return _context_getter[0]


def in_functorch_transform() -> bool:
    """Whether a ``torch.func`` transform (vmap, grad, jacrev, jvp, functionalize) is running the caller's ops:
    the tensors there are functorch's wrappers, and their gradients belong to the transform, not to the step's
    backward pass (per-sample gradients, as Opacus-style DP training computes them). A torch without the check
    (``torch._C._functorch.maybe_current_level``: torch 2.3.1 and 2.14 have it): never."""
    level = _functorch_level()
    return level is not None and level() is not None


@functools.cache
def _functorch_level() -> Callable[[], Any] | None:
    import torch

    level: Callable[[], Any] | None = getattr(getattr(torch._C, "_functorch", None), "maybe_current_level", None)
    return level


def functorch_unwrapped(tensor: Any) -> Any:
    """The plain tensor inside functorch's wrappers: a tensor made inside ``torch.func.vmap`` / ``grad`` and kept past
    the transform (a model's inputs under per-sample gradients) holds the whole batch's values there, and raises
    when used itself. ``tensor`` when it wraps none."""
    import torch

    functorch = getattr(torch._C, "_functorch", None)
    wrapped = getattr(functorch, "is_functorch_wrapped_tensor", None)
    unwrap = getattr(functorch, "get_unwrapped", None)
    while wrapped is not None and unwrap is not None and wrapped(tensor):
        tensor = unwrap(tensor)
    return tensor
