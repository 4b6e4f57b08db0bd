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

FP16_GRADIENTS = (
    "optimizer {optimizer} has float16 parameters; torch's GradScaler would raise "
    "'Attempting to unscale FP16 gradients.' ampguard unscales them in float16 and overflow "
    "skipping keeps working, but small gradients underflow to zero and the weight updates "
    "lose precision. Fix: keep the weights in float32 and train under fp16 autocast "
    "(do not load the model with torch_dtype=torch.float16 for training), or use bf16 where "
    "the GPU has it natively. AMPGUARD_FP16_GRADS=error restores torch's error."
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

LOSS_WAS_NONFINITE = (
    " The loss itself was inf/NaN before scaling: the forward pass overflowed, "
    "which no loss scale can fix."
)
