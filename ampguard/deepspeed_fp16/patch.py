"""Patch ``deepspeed_fp16``: DeepSpeed's fp16 dynamic loss scaling follows ampguard's policy (docs/deepspeed.md).

ampguard never imports DeepSpeed. A post-import hook (wrapt's, as for the trainer
libraries in :mod:`ampguard.trainer_logs.attach`) binds the replacements of
:mod:`ampguard.deepspeed_fp16.hooks` on DeepSpeed's classes when ``deepspeed`` is
imported, and at once when it already is; uninstall puts DeepSpeed's methods
back. A DeepSpeed version outside :data:`SUPPORTED`, or one whose methods are not
where this patch expects them, is left as it is, with one INFO line saying why
(at install: the patch is reported unavailable with that reason).
``AMPGUARD_DEEPSPEED=off`` (or ``AMPGUARD_DISABLE=deepspeed_fp16``) leaves DeepSpeed alone.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

import ampguard.containment as containment
import ampguard.deepspeed_fp16.checkpoint as checkpoint
import ampguard.deepspeed_fp16.hooks as hooks
import ampguard.deepspeed_fp16.losses as losses
from ampguard.config import Config
from ampguard.deepspeed_fp16.tracking import Policy
from ampguard.errors import PatchUnavailable
from ampguard.log import logger
from ampguard.patch import Patch, release_in, torch_release

# The DeepSpeed releases this patch was run against (docs/deepspeed.md says which, and with what).
SUPPORTED = ">=0.19.8,<0.20"
DEFAULT_START = 1024.0

# (module, class, method, replacement maker): what the patch binds.
_TARGETS: tuple[tuple[str, str, str, Any], ...] = (
    (
        "deepspeed.runtime.precision_config",
        "DeepSpeedFP16Config",
        "dynamic_loss_scale_args",
        hooks.dynamic_loss_scale_args,
    ),
    ("deepspeed.runtime.precision_config", "DeepSpeedFP16Config", "initial_dynamic_scale", hooks.initial_dynamic_scale),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler", "update_scale", hooks.update_scale),
    # a static loss_scale at ZeRO 1-3 (LossScaler inherits it; DynamicLossScaler has its own)
    ("deepspeed.runtime.fp16.loss_scaler", "LossScalerBase", "update_scale", hooks.static_update_scale),
    (
        "deepspeed.runtime.fp16.unfused_optimizer",
        "FP16_UnfusedOptimizer",
        "_update_scale",
        hooks.optimizer_update_scale,
    ),
    ("deepspeed.runtime.fp16.fused_optimizer", "FP16_Optimizer", "_update_scale", hooks.optimizer_update_scale),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "backward", losses.engine_backward),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "scale", losses.engine_backward),  # scale(loss).backward()
    *(
        (module_name, class_name, method, make)
        for module_name, class_name in (
            ("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer"),
            ("deepspeed.runtime.fp16.fused_optimizer", "FP16_Optimizer"),
            ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"),
            ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"),
        )
        for method, make in (("state_dict", checkpoint.state_dict), ("load_state_dict", checkpoint.load_state_dict))
    ),
)


def unsupported(module: ModuleType) -> str | None:
    """Why this DeepSpeed cannot be patched, or None."""
    version = str(getattr(module, "__version__", ""))
    try:
        if not release_in(torch_release(version), SUPPORTED):
            return f"needs deepspeed {SUPPORTED}, this is {version}"
    except Exception:
        return f"needs deepspeed {SUPPORTED}, this reports its version as {version!r}"
    for module_name, class_name, method, _ in _TARGETS:
        owner = getattr(importlib.import_module(module_name), class_name, None)
        if owner is None or not callable(vars(owner).get(method)):
            return f"deepspeed {version} has no {class_name}.{method} (from {module_name})"
    return None


class DeepSpeedFp16Patch(Patch):
    name = "deepspeed_fp16"
    summary = (
        "DeepSpeed's fp16 loss scaling (ZeRO 0-3): a safe start (1024), a floor instead of "
        "'Exiting run', exact skip counting in ampguard's stats lines; applied when deepspeed is imported"
    )
    requires_torch = ">=2.3"

    def __init__(self) -> None:
        super().__init__()
        self.policy: Policy | None = None
        self.attached = False

    def apply(self, config: Config) -> None:
        if not config.deepspeed:
            return
        module = sys.modules.get("deepspeed")
        if module is not None:
            reason = unsupported(module)
            if reason is not None:
                raise PatchUnavailable(reason)
        self.policy = Policy(
            start=config.init_scale or DEFAULT_START,
            floor=config.min_scale,
            cap=config.max_scale,
            max_consecutive_skips=config.max_consecutive_skips,
            on_stall=config.on_stall,
            stats_every=config.stats_every,
        )
        from ampguard.registry import when_imported  # (the registry imports the patches)

        when_imported(self, "deepspeed", _attach)

    def attach(self, module: ModuleType) -> None:
        """Bind the replacements on DeepSpeed's classes (``module``: ``deepspeed``, imported)."""
        reason = unsupported(module)
        if reason is not None:
            logger.info("ampguard leaves DeepSpeed's fp16 loss scaling as it is: %s.", reason)
            return
        assert self.policy is not None
        for module_name, class_name, method, make in _TARGETS:
            owner = getattr(importlib.import_module(module_name), class_name)
            self.bindings.set_attribute(owner, method, make(vars(owner)[method], self.policy))
        self.attached = True

    def revert(self) -> None:
        self.attached = False
        self.policy = None
        super().revert()


def _attach(patch: DeepSpeedFp16Patch, module: ModuleType) -> None:
    if patch.attached or patch.policy is None:  # (no policy: AMPGUARD_DEEPSPEED off, nothing to attach)
        return
    try:
        patch.attach(module)
    except Exception as error:  # a hook inside somebody's import: never let it fail
        patch.bindings.undo()
        containment.report("deepspeed_fp16 hook", error)
