"""Which module overflowed float16 in the forward pass: a probe armed only after a non-finite loss.

Nothing here runs on a healthy step. After an optimizer step whose loss was
inf/NaN, :mod:`ampguard.fp32_islands.healing` arms the probe: two global module hooks
(``register_module_forward_pre_hook`` / ``register_module_forward_hook``) that
see every module call of the following forward passes. For each call the
probe notes, on the device, whether the floating-point inputs were finite and
whether the output is (tensors in any nesting: :mod:`ampguard.fp32_islands.tensor_tree`), and
on the host the dtypes of its floating outputs (an island made of the module
gives them again); the first call (in the order calls *finish*, so the
innermost module comes first) whose output holds inf/NaN while its inputs did
not is the verdict: ``index + 1`` in a float32 device scalar, 0 while there is
none. No host read: the scaler adds the verdict to the one number it reads
per step anyway (found_inf in bit 0, loss non-finite in bit 1).

Each recorded call keeps the outermost module called (the *root*); the
module's name is qualified from the top-level module above it
(:mod:`ampguard.fp32_islands.model_tree`), seen through DDP / DataParallel / DeepSpeed /
Lightning Fabric / torch.compile wrappers (:func:`unwrap`).
Only positional inputs are checked (global hooks do not see keyword
arguments), and compiled code is opaque: inside ``torch.compile`` the hooks do
nothing, so a compiled model is seen as one module.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch

from ampguard.fp32_islands.island_io import output_kinds
from ampguard.fp32_islands.tensor_tree import tensors, values_in
from ampguard.module_hooks import GlobalModuleHooks
from ampguard.torch_privates import is_compiling

# The verdict travels as index + 1 in VERDICT_BITS bits of the scaler's packed read (ampguard.scaler.listeners).
VERDICT_BITS = 20
MAX_CALLS = 2**VERDICT_BITS - 1

# Wrappers around the user's model (by class name) and the attribute holding it: names are relative to that model.
WRAPPERS = {
    "DistributedDataParallel": "module",
    "DataParallel": "module",
    "FullyShardedDataParallel": "module",
    "DeepSpeedEngine": "module",
    # Lightning Fabric's setup(): the model passed in (its _forward_module may be DDP around it). The wrapper passes
    # attribute lookups on to it, so a name in the model works on the wrapper too.
    "_FabricModule": "_original_module",
}


def nonfinite_mark(leaves: list[torch.Tensor]) -> torch.Tensor | None:
    """NaN when a floating tensor of ``leaves`` holds inf/NaN, else 0 (a device scalar); None without any."""
    mark: torch.Tensor | None = None
    for leaf in leaves:
        if leaf.is_floating_point() and leaf.layout == torch.strided and leaf.numel():
            t = leaf.detach()
            check = (t - t).sum().float()  # 0, or NaN if any element is inf/NaN
            mark = check if mark is None else mark + check.to(mark.device)
    return mark


def unwrap(root: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / DataParallel / FSDP / DeepSpeed / Fabric / torch.compile wrappers (names are relative to it)."""
    while True:
        inner = getattr(root, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module) and type(root).__name__ in WRAPPERS:
            inner = getattr(root, WRAPPERS[type(root).__name__], None)
        if not isinstance(inner, torch.nn.Module):
            return root
        root = inner


def is_compiled(root: torch.nn.Module) -> bool:
    """Whether ``root`` runs compiled: ``torch.compile(module)``, or ``module.compile()`` (compiled in place)."""
    return any(
        isinstance(getattr(m, "_orig_mod", None), torch.nn.Module)
        or getattr(m, "_compiled_call_impl", None) is not None
        for m in (root, unwrap(root))
    )


def qualified_name(module: torch.nn.Module, root: torch.nn.Module) -> str | None:
    """``module``'s name in ``root`` ('' for the root itself), or None when it is not inside it."""
    inner = unwrap(root)
    if module is root or module is inner:
        return ""
    for name, sub in inner.named_modules(remove_duplicate=False):
        if sub is module:
            return str(name)
    return None


class Call(NamedTuple):
    """One module call the probe recorded."""

    module: torch.nn.Module
    root: torch.nn.Module
    outputs: tuple[str, ...] | None  # its floating outputs' dtypes under autocast (ampguard.fp32_islands.island_io)


class Probe:
    """Global forward hooks recording, on the device, the first module call that turned finite inputs into inf/NaN."""

    def __init__(self) -> None:
        self._hooks = GlobalModuleHooks(self._before, self._after)
        self._local = threading.local()
        self.calls: list[Call] = []
        self.verdict: torch.Tensor | None = None

    @property
    def armed(self) -> bool:
        return self._hooks.armed

    def arm(self) -> None:
        if self._hooks.armed:
            return
        self.reset()
        self._hooks.arm()

    def disarm(self) -> None:
        self._hooks.disarm()
        self.reset()

    def reset(self) -> None:
        """Forget the calls and the verdict (after each optimizer step's read)."""
        self.calls = []
        self.verdict = None
        self._local.stack = []

    def add_to(self, code: torch.Tensor, weight: float) -> torch.Tensor:
        """``code + weight * verdict``: the verdict joins the scaler's one host read."""
        if self.verdict is None:
            return code
        return code + weight * self.verdict.to(code.device, non_blocking=True)

    def call(self, index: int) -> Call | None:
        """The call of a decoded verdict (``index`` as read: 1-based), if recorded."""
        return self.calls[index - 1] if 0 < index <= len(self.calls) else None

    def _stack(self) -> list[tuple[torch.nn.Module, torch.Tensor | None]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        if is_compiling():
            return
        try:
            self._stack().append((module, nonfinite_mark(values_in(args, depth=0))))  # (nested tensors' values too)
        except Exception:  # a diagnostic must never break the forward pass
            self._stack().append((module, None))

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if is_compiling():
            return
        stack = self._stack()
        if not stack or stack[-1][0] is not module:
            return
        _, inputs_mark = stack.pop()
        if output is None or len(self.calls) >= MAX_CALLS:
            return
        try:
            leaves = tensors(output)
            output_mark = nonfinite_mark(leaves)
            if output_mark is None:
                return
            root = stack[0][0] if stack else module
            self.calls.append(Call(module, root, output_kinds(leaves)))
            bad = output_mark.isnan()
            if inputs_mark is not None:
                bad = bad & ~inputs_mark.to(bad.device).isnan()
            if self.verdict is None:
                self.verdict = torch.zeros((), dtype=torch.float32, device=bad.device)
            fresh = bad.to(self.verdict.device) & (self.verdict == 0)
            self.verdict = torch.where(fresh, float(len(self.calls)), self.verdict)
        except Exception:
            return
