"""Every selftest check, in the order they run, with the patches and settings each is about."""

from __future__ import annotations

import ampguard.commands.selftest.clipping as clipping
import ampguard.commands.selftest.device as device
import ampguard.commands.selftest.headroom as headroom
import ampguard.commands.selftest.scaling as scaling
import ampguard.commands.selftest.training as training
import ampguard.commands.selftest.underflow as underflow
from ampguard.commands.selftest.runner import Check
from ampguard.config import Config


def islands_made(config: Config) -> str | None:
    if config.fp32_islands == "auto":
        return None
    return (
        f"AMPGUARD_FP32_ISLANDS={config.fp32_islands}: a module that overflows float16 is named, not run in "
        "float32: no island to check"
    )


def watch_on(config: Config) -> str | None:
    return None if config.watch_every else "AMPGUARD_WATCH_EVERY=0: the headroom watch is off"


def underflow_on(config: Config) -> str | None:
    return "AMPGUARD_UNDERFLOW=off: no step is sampled" if config.underflow == "off" else None


CHECKS: list[Check] = [
    Check("skips_and_parity_sgd", scaling.skips_and_parity_sgd, ("grad_scaler",)),
    Check("skips_and_parity_fused_adam", scaling.skips_and_parity_fused_adam, ("grad_scaler",)),
    Check("host_reads", scaling.host_reads, ("grad_scaler",)),
    Check(
        "forward_overflow_healed", training.forward_overflow_healed, ("grad_scaler", "fp32_islands"), (islands_made,)
    ),
    Check(
        "headroom_watch",
        headroom.headroom_watch,
        ("grad_scaler", "fp32_islands"),
        (islands_made, watch_on),
        tuple(headroom.SCHEDULE.items()),
    ),
    Check("underflow_sampled", underflow.underflow_sampled, ("grad_scaler", "underflow"), (underflow_on,)),
    Check("fp16_model_with_masters", training.fp16_model_with_masters, ("master_weights",)),
    Check("clip_after_unscale", clipping.clip_after_unscale, ("grad_scaler", "clip_grad")),
    Check("clip_without_unscale", clipping.clip_without_unscale, ("grad_scaler", "clip_grad")),
    Check("kernels_per_step", clipping.ops_per_step, ("grad_scaler", "clip_grad")),
    Check("bf16_truth", device.bf16_truth, ()),
    Check("legacy_spellings", device.legacy_spellings, ("autocast",)),
]


def by_name(name: str) -> Check:
    return next(check for check in CHECKS if check.name == name)
