"""Which autograd nodes a sample counts the incoming gradient of, and the regions it steps aside from.

A view's gradient holds its base's values (:data:`SAME_VALUES`: walked through, not counted twice); a float32
leaf's gradient is never float16; a compiled region's backward is one node
(:data:`COMPILED_NODE_KINDS`), whose incoming gradient is the region's output's only: counting it would
measure a handful of values as the region's, so the sample steps aside there and says so once; so it does
for a loss whose model it saw no module call of (:data:`UNSEEN`), and inside torch.func transforms
(:data:`TRANSFORMED`).
"""

from __future__ import annotations

from typing import Any, TypeGuard

import torch
from torch import nn

from ampguard.log import event_logger

logger = event_logger("underflow")

# Said once per process and region at INFO when a walk meets a compiled region's backward node.
COMPILED = (
    "underflow sample: the gradients inside the compiled region {region} are not counted (torch.compile makes its "
    "backward one node, whose values ampguard cannot see); the rest of the model is sampled as usual."
)
COMPILED_NODE_KINDS = frozenset({"CompiledFunctionBackward"})
_said: set[str] = set()  # the step-aside lines said in this process


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.info(message)


def step_aside_compiled(module: nn.Module, name: str) -> None:
    """Say once that the compiled region met by ``module``'s walk (``module`` named ``name``) is not counted."""
    if type(module).__name__ == "OptimizedModule":
        region = f"{name} (torch.compile of {type(getattr(module, '_orig_mod', module)).__name__})"
    else:
        region = f"called in {name} (a compiled function)"
    _say_once(COMPILED.format(region=region))


# Said once per process at INFO when a scaled loss is given to a sample that walked no module call's graph.
UNSEEN = (
    "underflow sample: no module call of the model ran where the sample can see it (model.compile() runs them "
    "compiled; a model of plain functions has none): its gradients are not counted, and the scale follows torch's "
    "schedule."
)


def step_aside_unseen() -> None:
    _say_once(UNSEEN)


# Said once per process at INFO when scale() is given an iterator of losses (a generator: torch maps it lazily).
LAZY_LOSSES = (
    "underflow sample: the losses given to scaler.scale() in an iterator (a generator, a map) cannot be looked at "
    "without consuming it: their backward passes are not counted, and the scale follows torch's schedule for "
    "them. Pass a list or a tuple of losses to have them sampled."
)


def step_aside_lazy_losses() -> None:
    _say_once(LAZY_LOSSES)


# Said once per process at INFO when the sample first meets a torch.func transform.
TRANSFORMED = (
    "underflow sample: gradients computed inside a torch.func transform (vmap, grad, jacrev: per-sample gradients) "
    "are not counted; they are the transform's, and their tensors are functorch's wrappers. The step's own backward "
    "pass is sampled as usual."
)


def step_aside_transformed() -> None:
    _say_once(TRANSFORMED)


# Nodes whose incoming gradient holds the same values as a gradient counted elsewhere (a view's, a slice's, a
# split's pieces, a clone's, an in-place write's through a view, CopySlices: its base's): walked through, not
# counted twice.
SAME_VALUES = frozenset(
    {
        "AliasBackward0",
        "AsStridedBackward0",
        "CloneBackward0",
        "CopySlices",
        "ExpandBackward0",
        "PermuteBackward0",
        "ReshapeAliasBackward0",
        "SelectBackward0",
        "SliceBackward0",
        "SplitBackward0",
        "SplitWithSizesBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "TBackward0",
        "TransposeBackward0",
        "UnbindBackward0",
        "UnsafeSplitBackward0",
        "UnsafeViewBackward0",
        "UnsqueezeBackward0",
        "ViewBackward0",
    }
)


def counted(node: Any) -> bool:
    """Whether ``node``'s incoming gradient is counted: not a view's (counted as its base's), and a leaf's
    accumulator only for a float16 leaf (a float32 master's gradient is never float16)."""
    kind = type(node).__name__
    if kind == "AccumulateGrad":
        return bool(node.variable.dtype == torch.float16)
    return kind not in SAME_VALUES


def countable(gradient: torch.Tensor | None) -> TypeGuard[torch.Tensor]:
    """A dense float16 gradient with values (sparse and nested ones are not counted)."""
    return dense(gradient) and gradient.dtype == torch.float16


def dense(gradient: torch.Tensor | None) -> TypeGuard[torch.Tensor]:
    """A dense floating gradient with values."""
    return (
        gradient is not None
        and gradient.is_floating_point()
        and gradient.layout == torch.strided
        and not gradient.is_nested
        and gradient.numel() > 0
    )
