"""The explanations ampguard logs, in one place (docs/troubleshooting.md expands on each)."""

from __future__ import annotations

NO_GRADIENTS = (
    "optimizer {optimizer} got no gradient for any of its parameters this iteration; "
    "torch's GradScaler would raise 'No inf checks were recorded for this optimizer.' "
    "ampguard ran optimizer.step() as fp32 training would and counts it in stats.no_grad_steps. "
    "Likely causes: the loss is not connected to the parameters this optimizer trains; "
    "the parameters are frozen (requires_grad=False) or only LoRA adapters are trainable "
    "while the optimizer holds the base weights; the optimizer was built before the model "
    "was moved to its device, so it holds the old parameter tensors."
)

NO_INF_CHECKS_CLOSURE = (
    "No inf checks were recorded for this optimizer. (torch's error: scaler.step(optimizer, closure) was "
    "called before any gradient existed, and GradScaler does not support closures: the gradients the "
    "closure makes would be scaled and never checked. Run the forward and scaler.scale(loss).backward() "
    "yourself, then scaler.step(optimizer) without a closure.)"
)

FP16_GRADIENTS = (
    "optimizer {optimizer} has float16 parameters without float32 master weights "
    "(AMPGUARD_MASTER_WEIGHTS=off, or an optimizer ampguard cannot wrap); torch's GradScaler would raise "
    "'Attempting to unscale FP16 gradients.' ampguard unscales them in float16 and overflow "
    "skipping keeps working, but small gradients underflow to zero and the optimizer steps the float16 "
    "weights themselves: small updates round away and AdamW can turn them into NaN. Fix: leave "
    "AMPGUARD_MASTER_WEIGHTS at its default (fp16) with an optimizer ampguard can wrap, or keep the weights "
    "in float32 and train under fp16 autocast. AMPGUARD_FP16_GRADS=error restores torch's error."
)

SCALE_COLLAPSE = (
    "the loss scale collapsed: step {step} overflowed with the scale at {scale:g}{floor}. "
    "No loss scale can help now. Likely causes: weights pretrained in bf16 overflow float16 "
    "in the forward pass (run that block in bf16 or fp32, or train in bf16 on a GPU with "
    "native bf16); the learning rate is too high; gradients are not clipped "
    "(torch.nn.utils.clip_grad_norm_ after scaler.unscale_)."
)

STALL = (
    "{count} consecutive optimizer steps were skipped for inf/NaN gradients (step {step}, "
    "scale {scale:g}); training is not progressing.{loss} "
    "Set AMPGUARD_ON_STALL=raise to stop the run here, or see docs/troubleshooting.md."
)

STALL_RAISED = (
    "{count} consecutive optimizer steps were skipped for inf/NaN gradients (step {step}, "
    "scale {scale:g}); training is not progressing.{loss} "
    "The run was stopped here because AMPGUARD_ON_STALL=raise (the limit is "
    "AMPGUARD_MAX_CONSECUTIVE_SKIPS={limit}); update() completed its iteration first, so the scaler's "
    "state is consistent for a checkpoint. See docs/troubleshooting.md."
)

MALFORMED_COUNTERS = (
    "the loaded GradScaler state's \"ampguard\" entry is not ampguard's ({error}): torch's keys are loaded, "
    "and the counters in scaler.stats (and the capabilities' state) stay this scaler's own."
)

TORCH_STATE_LOADED = (
    "loaded a GradScaler state saved without ampguard: its scale {scale:g} and growth interval "
    "{interval} are kept (torch's defaults are 65536 and 2000; ampguard's are 1024 and 100). "
    "AMPGUARD_GROWTH_INTERVAL overrides the interval, AMPGUARD_MAX_SCALE caps the scale; "
    "the counters in scaler.stats start from this scaler's own."
)

LOSS_WAS_NONFINITE = (
    " The loss itself was inf/NaN before scaling: the forward pass overflowed, which no loss scale can fix."
)

PARAMETERS_NONFINITE = (
    "step {step} skipped{at_scale}: the parameters themselves hold inf/NaN: {total} of the {checked} parameters "
    "checked ({optimizer}'s and those of watched models): {names}.{hint} This is no overflow a loss scale can fix: "
    "every forward pass through them gives inf/NaN, so every step will be skipped. They were corrupted before "
    "this step: by an optimizer step on float16/bfloat16 weights without float32 master weights "
    "(AMPGUARD_MASTER_WEIGHTS, docs/master-weights.md), by a step taken with inf/NaN gradients outside a "
    "GradScaler, or by loading weights that already held inf/NaN. Reload the last good checkpoint."
)

PARAMETERS_NOTE = (
    " The parameters themselves hold inf/NaN ({names}): no loss scale, learning rate or clipping can help; "
    "reload the last good checkpoint (see the skipped-step report)."
)

SCALE_COLLAPSE_PARAMETERS = "the loss scale collapsed: step {step} overflowed with the scale at {scale:g}{floor}.{note}"

ISLAND_MADE = (
    "fp32 island: {name} ({cls}) overflowed float16 in the forward pass (inf/NaN output from finite inputs, "
    "step {step}). From now on it runs in float32: autocast disabled inside it, its floating-point inputs "
    "cast to float32 and its outputs given back in the dtypes they had; {parameters} and the loss scale was not lowered for this overflow. "
    "To make this permanent without ampguard (model: your {owner}): {line}"
)

# The forward-overflow probe (ampguard.fp32_islands.healing).
PROBE_BACKING_OFF = (
    "the forward-overflow probe looks less often: its last {count} verdicts made no fp32 island (the overflows "
    "come from the data, from code outside any module, or from modules it may not change: see the warnings "
    "above). It now lets {skip} forward overflows pass before it looks again, twice as many after each such "
    "verdict. They are still skipped and counted, without lowering the loss scale."
)

PROBE_UNLOCATED = (
    "step {step} overflowed in the forward pass while the probe watched, but no module turned finite inputs "
    "into inf/NaN: the batch itself held inf/NaN, the overflow is in code outside any module (a loss computed "
    "by plain functions), an input passed only as a keyword argument, or compiled code. No fp32 island made."
)

BAD_BATCH = (
    "step {step}: the loss was inf/NaN and the batch itself held inf/NaN (the model's inputs): the data's fault, "
    "no module's. The step is skipped and counted, the loss scale kept; no module is blamed, no fp32 island made."
)

NOT_RUN_AGAIN = (
    "forward overflow at step {step}: its forward pass is not run again to find the module ({reason}); the probe "
    "watches the next forward passes instead, and names the module at the next overflow."
)


ISLAND_AHEAD = (
    "fp32 island: {name} ({cls}) came within AMPGUARD_HEADROOM={headroom:g} of float16's limit before any overflow: "
    "the headroom watch saw a peak of {peak:,.0f} against float16's 65,504 ({share:.0%} of it) inside it in the "
    "forward pass of step {step}. From now on it runs in float32: autocast disabled inside it, its floating-point "
    "inputs cast to float32 and its outputs given back in the dtypes they had; {parameters}. "
    "To make this permanent without ampguard (model: your {owner}): {line}"
)

ISLAND_AHEAD_REPORT = (
    "headroom watch: {name} ({cls}) came within AMPGUARD_HEADROOM={headroom:g} of float16's limit: a peak of "
    "{peak:,.0f} against float16's 65,504 ({share:.0%} of it) in the forward pass of step {step}. "
    "AMPGUARD_FP32_ISLANDS=report: nothing changed. To run it in float32 (model: your {owner}): {line} "
    "(or unset AMPGUARD_FP32_ISLANDS and ampguard does it)."
)

ISLAND_AHEAD_LIMIT = (
    "{name} ({cls}) came within AMPGUARD_HEADROOM={headroom:g} of float16's limit (a peak of {peak:,.0f} against "
    "65,504, step {step}), but {limit} modules already run in float32 ({names}) and AMPGUARD_MAX_ISLANDS={limit}: "
    "this model does not suit float16. Train in bf16 (on a GPU with native bf16) or float32."
)

ISLAND_BLAMED = (
    "fp32 island: {name} ({cls}) is taken for the forward overflow of step {step} (the loss was inf/NaN): the "
    "headroom watch of step {seen} saw it closest to float16's limit of all modules, with a peak of {peak:,.0f} "
    "against 65,504, so it is made an island at this first overflow (if overflows go on, the probe looks for "
    "the module, and this island is taken back if it names another). From now on it runs in float32: autocast disabled inside it, its floating-point inputs cast "
    "to float32 and its outputs given back in the dtypes they had; {parameters} and the loss "
    "scale was not lowered for this overflow. To make this permanent without ampguard (model: your {owner}): {line}"
)

ISLAND_TAKEN_BACK = (
    "fp32 island {name} ({cls}) taken back at step {step}: the forward overflow it was taken for came back, and "
    "{other} overflowed float16 (named by its forward run again or the probe), not {name}. {name} runs as under "
    "torch again; the line given to make it permanent is not needed."
)

ISLAND_BLAMED_REPORT = (
    "forward overflow at step {step}: the headroom watch of step {seen} saw {name} ({cls}) closest to float16's "
    "limit of all modules (a peak of {peak:,.0f} against 65,504). AMPGUARD_FP32_ISLANDS=report: nothing changed. "
    "To run it in float32 (model: your {owner}): {line} (or unset AMPGUARD_FP32_ISLANDS and ampguard does it)."
)

ISLAND_UNHELPFUL = (
    "fp32 island {name} ({cls}) overflowed again at step {step}, in float32: float32 does not fix this overflow "
    "(inf/NaN from finite inputs in any precision), so these steps stay skipped. Look at the data reaching it or "
    "at its computation; ampguard watches for new forward overflows less and less often. This message is shown once."
)

ISLAND_REPORT = (
    "forward overflow located: {name} ({cls}) turned finite inputs into inf/NaN (step {step}). "
    "AMPGUARD_FP32_ISLANDS=report: nothing changed. To run it in float32 (model: your {owner}): {line} "
    "(or unset AMPGUARD_FP32_ISLANDS and ampguard does it)."
)

ISLAND_ROOT = (
    "forward overflow located in {name} itself (step {step}), in code of its own forward() that no submodule "
    "owns (or in a loss computed by a module called on its own): ampguard does not run a whole model in float32. "
    "Move the overflowing computation into a submodule, wrap it in torch.autocast(device_type, enabled=False) "
    "with float32 inputs, or train in bf16 on a GPU with native bf16."
)

ISLAND_COMPILED = (
    "forward overflow in a torch.compile'd model ({name}, step {step}): ampguard cannot see or change modules "
    "inside compiled code. Run the model eagerly for one overflowing batch to let ampguard name the module, "
    "then apply this before torch.compile (model: your {owner}): {line}"
)

ISLAND_SCRIPTED = (
    "forward overflow located: {name} ({cls}) at step {step}, but it is a TorchScript module: ampguard cannot "
    "hook into scripted code or change it, so it leaves it as it is (and does not see which module inside it "
    "overflowed). Leave it unscripted and ampguard makes it an fp32 island at its next overflow, or call it in "
    "float32 yourself: inside torch.autocast(device_type, enabled=False), with float32 inputs."
)

ISLAND_LIMIT = (
    "{name} ({cls}) overflowed float16 in the forward pass (step {step}), but {limit} modules already run "
    "in float32 ({names}) and AMPGUARD_MAX_ISLANDS={limit}: this model does not suit float16. "
    "Train in bf16 (on a GPU with native bf16) or float32."
)

# fp32_islands.healing: the probe armed at a forward overflow (step, AMPGUARD_PROBE_STEPS), and disarmed (steps)
PROBE_ARMED = (
    "forward overflow at step %d: watching the next forward passes to find the module (AMPGUARD_PROBE_STEPS=%d)."
)
PROBE_DISARMED = "forward-overflow probe disarmed after %d steps without a forward overflow."
PROBE_ARMED_LEARNED = (
    "forward overflow %s learned at step %d (a fused optimizer: learned from the steps' verdicts copied to the host, "
    "without a sync): watching the next forward passes to find the module (AMPGUARD_PROBE_STEPS=%d)."
)
PROBE_STOPPED = (
    "ampguard's forward-overflow probe stopped after an error (%r) and does not arm again; training goes on "
    "without it (forward overflows are still skipped and counted, without lowering the loss scale)."
)
