"""A zoo of modern model features trained under ampguard with the headroom watch and the underflow sample on every step.

Issue 31: ampguard never breaks or bends a run that torch trains. Each feature is trained twice on the same batches
from the same seeds: with plain torch (ampguard uninstalled) and under ampguard with ``AMPGUARD_WATCH_EVERY=1`` and
``AMPGUARD_UNDERFLOW_EVERY=1`` (every step from the second is watched and sampled; ``AMPGUARD_UNDERFLOW=report``, so
the scale follows torch's schedule). Nothing overflows, so ampguard must give torch's weights bit for bit, make no
fp32 island, and log no WARNING and no contained error. Compiled code must run compiled on every step, as under
plain torch, and compile as many graphs as plain torch does (one).

Then two groups on what the watch measures:

* The watch never measures memory no op wrote: with the allocator poisoned (every block glibc hands out holds float16
  30,576s) a module's forward makes a buffer with ``torch.empty_like`` / ``torch.empty`` / ``new_empty`` and writes
  every value of it, or runs a Dropout (whose CPU kernel makes its mask with ``empty_like`` + ``bernoulli_``); 50
  watched steps make no island and no headroom reading of that module near the limit.
* Bad data is not a module: a model the watch sees close to the limit (tests/headroom_watch/test_headroom_watch_blame.py's) gets one
  batch with NaN or inf in its inputs: that step is skipped and counted, and no island is made.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import pytest
import torch
import torch.utils.checkpoint
from islands_support import CLASSES, DIM, Attention, Block, Net, Result, batch, fresh_islands, make_net, train  # noqa: F401
from scaler_support import ampguard_log, needs_fused_adam, one_thread  # noqa: F401  (fixtures)
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ampguard
import ampguard.messages as messages
from ampguard.fp32_islands.patch import applied_healing
from ampguard.patch import torch_release

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")

T = TypeVar("T")

STEPS = 8
WATCHED = {"AMPGUARD_WATCH_EVERY": "1", "AMPGUARD_UNDERFLOW_EVERY": "1", "AMPGUARD_UNDERFLOW": "report"}
TRAIN_SEED = 1234  # the global RNG's seed as training starts (Dropout), the same in both runs
# The headroom watch blames a module whose peak came within this of float16's limit (65,504 / 64, ampguard's
# BLAME_BOUND): a reading this high of a module whose real values stay in the units is a wrong one.
SUSPECT = 65504.0 / 64


# -- running a feature both ways --------------------------------------------------------------------------------


def plain_then_watched(reinstall: Callable[..., Any], run: Callable[[], T]) -> tuple[T, T]:
    """``run()`` with plain torch (ampguard uninstalled), then under ampguard watching and sampling every step."""
    ampguard.uninstall()
    reference = run()
    reinstall(**WATCHED)
    return reference, run()


def healthy_net(seed: int = 0) -> Net:
    """tests/support/islands_support.py's net with tame attention (logits in the tens: far from float16's limit)."""
    torch.manual_seed(seed)
    return Net(blocks=2, hot=1, sharpness=0.3)


def fit(model: nn.Module, *, adamw: bool = False, steps: int = STEPS, after_update: Any = None) -> Result:
    """islands_support.train on healthy batches, with the global RNG seeded as training starts (Dropout)."""
    if adamw:
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(TRAIN_SEED)
    return train(steps, model=model, optimizer=optimizer, healthy=True, after_update=after_update)


def underflow_report(record: logging.LogRecord) -> bool:
    """``AMPGUARD_UNDERFLOW=report``'s one WARNING that the sampled gradients underflow: a measurement of the model
    (tiny models' gradients often do), not trouble."""
    return getattr(record, "ampguard_event", None) == "underflow" and "were subnormal or lost" in record.getMessage()


def trouble(log: pytest.LogCaptureFixture) -> list[str]:
    """ampguard's WARNINGs (and worse) and its contained errors (a traceback at DEBUG) in the log."""
    return [
        f"{r.levelname}: {r.getMessage()}"
        for r in log.records
        if r.name.startswith("ampguard")
        and (r.levelno >= logging.WARNING or r.exc_info is not None)
        and not underflow_report(r)
    ]


def assert_trained_as_torch(reference: Result, ours: Result, log: pytest.LogCaptureFixture) -> None:
    assert reference.nonfinite_losses == 0  # the test's premise: nothing overflows with plain torch
    assert ours.nonfinite_losses == 0
    assert ours.scaler.stats.fp32_islands == ()
    assert trouble(log) == []
    assert ours.scales == reference.scales
    names = [name for name, _ in reference.model.named_parameters()]
    assert [name for name, _ in ours.model.named_parameters()] == names
    different = [
        name
        for name, theirs, mine in zip(names, reference.model.parameters(), ours.model.parameters())
        if not torch.equal(theirs, mine)
    ]
    assert different == [], "weights differ from plain torch's"


# -- compiled code, counted -------------------------------------------------------------------------------------


class Counting:
    """A dynamo backend: ``backend``'s compiled code, with the graphs compiled and the calls of their code counted."""

    def __init__(self, backend: str = "eager") -> None:
        self.backend = backend
        self.graphs = 0
        self.calls = 0
        self.per_step: list[int] = []  # the calls made by the end of each step

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs += 1
        compiled = (
            graph.forward
            if self.backend == "eager"
            else torch._dynamo.lookup_backend(self.backend)(graph, example_inputs)
        )

        def run(*args: Any) -> Any:
            self.calls += 1
            return compiled(*args)

        return run

    def step_done(self, step: int) -> None:
        self.per_step.append(self.calls)


OLD_DYNAMO_HOOKS = pytest.mark.xfail(
    torch_release().release < (2, 4),
    strict=True,
    reason="open (issue 31): torch 2.3.1's dynamo guards a region on torch's global module hooks (read by "
    "nn.Module._call_impl, inlined at each submodule call), empty ones included: the region is compiled again for the "
    "steps where ampguard's are armed (buffer discovery with the watch and the sample, then those 2): 3 graphs, not 1",
)


@pytest.fixture
def dynamo_reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def fit_compiled(build: Callable[[Counting], nn.Module], backend: str = "eager", adamw: bool = False):
    """A run of ``build(counting)``'s model from a clean dynamo cache: (its training, the counts)."""
    torch._dynamo.reset()
    counting = Counting(backend)
    return fit(build(counting), adamw=adamw, after_update=counting.step_done), counting


def assert_compiled_as_torch(reference: Counting, ours: Counting) -> None:
    # the test's premise: plain torch compiled once and ran the compiled code at every step
    assert reference.graphs == 1
    assert all(after > before for before, after in itertools.pairwise([0, *reference.per_step]))
    assert (ours.graphs, ours.per_step) == (reference.graphs, reference.per_step)


def assert_compiled_run(reinstall, log, build: Callable[[Counting], nn.Module], backend: str = "eager", adamw=False):
    (reference, their_counts), (ours, our_counts) = plain_then_watched(
        reinstall, lambda: fit_compiled(build, backend, adamw)
    )
    assert_trained_as_torch(reference, ours, log)
    assert_compiled_as_torch(their_counts, our_counts)


@OLD_DYNAMO_HOOKS
@pytest.mark.usefixtures("dynamo_reset")
@pytest.mark.parametrize("how", ["torch.compile(model, fullgraph=True)", "model.compile(fullgraph=True)"])
def test_a_model_compiled_whole_with_fullgraph(reinstall, ampguard_log, how: str):
    def build(counting: Counting) -> nn.Module:
        model = healthy_net()
        if how.startswith("torch.compile"):
            return torch.compile(model, fullgraph=True, backend=counting)
        model.compile(fullgraph=True, backend=counting)
        return model

    assert_compiled_run(reinstall, ampguard_log, build, adamw=True)


@OLD_DYNAMO_HOOKS
@pytest.mark.usefixtures("dynamo_reset")
def test_a_model_compiled_in_place_without_fullgraph(reinstall, ampguard_log):
    def build(counting: Counting) -> nn.Module:
        model = healthy_net()
        model.compile(backend=counting)
        return model

    assert_compiled_run(reinstall, ampguard_log, build)


@OLD_DYNAMO_HOOKS
@pytest.mark.usefixtures("dynamo_reset")
@pytest.mark.parametrize("how", ["torch.compile(block, fullgraph=True)", "block.compile(fullgraph=True)"])
def test_a_submodule_compiled_with_fullgraph_inside_an_eager_model(reinstall, ampguard_log, how: str):
    """The hot block compiled (aot_eager) inside a model that is not: the watch sees the rest, the block runs
    compiled at every step, watched or not."""

    def build(counting: Counting) -> nn.Module:
        model = healthy_net()
        if how.startswith("torch.compile"):
            model.blocks[1] = torch.compile(model.blocks[1], fullgraph=True, backend=counting)
        else:
            model.blocks[1].compile(fullgraph=True, backend=counting)
        return model

    assert_compiled_run(reinstall, ampguard_log, build, backend="aot_eager")


class GatedMLP(nn.Module):
    """An MLP whose gate is a helper function (compiled on its own: a fused activation)."""

    def __init__(self, gate: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(DIM, DIM)
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.gate(self.up(x)))


def swiglu(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return F.silu(a) * b


@pytest.mark.usefixtures("dynamo_reset")
def test_a_helper_function_compiled_with_inductor_and_fullgraph_inside_an_eager_model(reinstall, ampguard_log):
    """``torch.compile(swiglu, fullgraph=True)`` (inductor: its own kernels) called by an eager module. Were it run
    eagerly on a watched step, the float16 rounding of aten's kernels would differ from the fused kernel's."""

    def build(counting: Counting) -> nn.Module:
        model = healthy_net()
        torch.manual_seed(1)
        model.blocks[0].mlp = GatedMLP(torch.compile(swiglu, fullgraph=True, backend=counting))
        return model

    assert_compiled_run(reinstall, ampguard_log, build, backend="inductor")


# -- attention kernels and higher-order operators ---------------------------------------------------------------


class FlexAttention(nn.Module):
    """Attention through flex_attention (``attend``: eager, or compiled as HF's ``attn_implementation="flex_attention"``
    calls it). torch has no flex_attention backward on the CPU (NotImplementedError), so its inputs are detached: the
    layers after it train."""

    def __init__(self, attend: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, DIM)
        self.k = nn.Linear(DIM, DIM)
        self.v = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, DIM)
        self.attend = attend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (
            projection(x).detach().unflatten(-1, (2, DIM // 2)).transpose(1, 2)
            for projection in (self.q, self.k, self.v)
        )
        return self.out(self.attend(q, k, v).transpose(1, 2).flatten(-2))


@pytest.mark.usefixtures("dynamo_reset")
@pytest.mark.filterwarnings("ignore::UserWarning")  # flex_attention called without torch.compile()
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "torch.compile(flex_attention)"])
def test_flex_attention_inside_an_eager_model(reinstall, ampguard_log, compiled: bool):
    flex = pytest.importorskip("torch.nn.attention.flex_attention", reason="flex_attention: torch >= 2.5")

    def build(counting: Counting) -> nn.Module:
        model = healthy_net()
        torch.manual_seed(1)
        attend = (
            torch.compile(flex.flex_attention, dynamic=False, backend=counting) if compiled else flex.flex_attention
        )
        model.blocks[1].attn = FlexAttention(attend)
        return model

    (reference, their_counts), (ours, our_counts) = plain_then_watched(
        reinstall, lambda: fit_compiled(build, "aot_eager")
    )
    assert_trained_as_torch(reference, ours, ampguard_log)
    if compiled:
        assert_compiled_as_torch(their_counts, our_counts)


class Branches(nn.Module):
    """``torch.cond`` on the data: one of two projections."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.mean() > 0, self.a, self.b, (x,))


@pytest.mark.usefixtures("dynamo_reset")
def test_torch_cond(reinstall, ampguard_log):
    def run() -> Result:
        torch._dynamo.reset()
        model = healthy_net()
        torch.manual_seed(1)
        model.blocks[0].mlp = nn.Sequential(nn.Linear(DIM, DIM), Branches())
        return fit(model)

    ampguard.uninstall()
    try:
        reference = run()
    except RuntimeError as error:
        if "Autograd not implemented for cond" in str(error):  # torch 2.3.1
            pytest.skip(f"this torch cannot train through torch.cond ({error})")
        raise
    reinstall(**WATCHED)
    assert_trained_as_torch(reference, run(), ampguard_log)


class SdpaAttention(Attention):
    """islands_support's attention through F.scaled_dot_product_attention, two heads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (
            projection(x).unflatten(-1, (2, DIM // 2)).transpose(1, 2) for projection in (self.q, self.k, self.v)
        )
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2))


class Mha(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(DIM, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize("attention", ["scaled_dot_product_attention", "nn.MultiheadAttention"])
def test_attention_kernels(reinstall, ampguard_log, attention: str):
    def run() -> Result:
        model = healthy_net()
        torch.manual_seed(1)
        for block in model.blocks:
            block.attn = SdpaAttention(DIM) if attention == "scaled_dot_product_attention" else Mha()
        return fit(model, adamw=True)

    assert_trained_as_torch(*plain_then_watched(reinstall, run), ampguard_log)


# -- buffers, dropout, checkpointing, sentinels, keyword calls --------------------------------------------------


class EmptyMoE(nn.Module):
    """Tokens routed to two experts through a dispatch buffer: ``out = torch.empty_like(h); out[sel] = expert(h[sel])``
    (every token is routed, so every value of ``out`` is written; the real values stay in the units)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.router = nn.Linear(DIM, 2)
        self.experts = nn.ModuleList([Attention(DIM, 0.3), Attention(DIM, 0.3)])
        self.head = nn.Linear(DIM, CLASSES)
        nn.init.zeros_(self.router.bias)  # a balanced start: both experts get tokens at every step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).reshape(-1, DIM)
        choice = self.router(h).argmax(-1)
        out = torch.empty_like(h)
        for number, expert in enumerate(self.experts):
            sel = choice == number
            out[sel] = expert(h[sel])
        return self.head((h + out).reshape(x.shape).mean(1))


def test_an_moe_layer_with_an_empty_like_dispatch_buffer(reinstall, ampguard_log):
    def run() -> Result:
        torch.manual_seed(0)
        return fit(EmptyMoE(), adamw=True)

    assert_trained_as_torch(*plain_then_watched(reinstall, run), ampguard_log)


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = healthy_net()
        for block in self.net.blocks:
            block.mlp.insert(2, nn.Dropout(0.1))  # up, GELU, Dropout, down
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.dropout(x))


def test_dropout_in_training_mode(reinstall, ampguard_log):
    """Seeded the same in both runs: the same masks."""
    assert_trained_as_torch(*plain_then_watched(reinstall, lambda: fit(Dropped())), ampguard_log)


class Checkpointed(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)  # (reentrant checkpointing needs an input that requires grad)
        self.blocks = nn.ModuleList(Block(DIM, 0.3) for _ in range(2))
        self.head = nn.Linear(DIM, CLASSES)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            if self.how == "reentrant":
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True)
            elif self.how == "non-reentrant":
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            else:  # selective: matrix products saved, the rest recomputed
                save = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default]
                context = partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, save)
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False, context_fn=context)
        return self.head(h.mean(1))


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant", "selective"])
def test_activation_checkpointing(reinstall, ampguard_log, how: str):
    if how == "selective" and not hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts"):
        pytest.skip("torch.utils.checkpoint.create_selective_checkpoint_contexts: torch >= 2.4")

    def run() -> Result:
        torch.manual_seed(0)
        return fit(Checkpointed(how))

    assert_trained_as_torch(*plain_then_watched(reinstall, run), ampguard_log)


class MaskedMinPool(nn.Module):
    """Masked min-pooling over the tokens: padding filled with float16's largest value so that it never wins."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        h = self.proj(h)
        return h.masked_fill(~valid[..., None], torch.finfo(h.dtype).max).amin(1)


class MinPooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.pool = MaskedMinPool()
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        valid = x[..., 0] > -0.5  # padding, by the data
        valid[:, 0] = True
        return self.head(self.pool(self.embed(x), valid))


def test_a_masked_min_sentinel(reinstall, ampguard_log):
    """``h.masked_fill(~valid, finfo(h.dtype).max).amin(1)`` holds 65,504 by construction: no activation near the
    limit, nothing to make an island of."""

    def run() -> Result:
        torch.manual_seed(0)
        return fit(MinPooled())

    assert_trained_as_torch(*plain_then_watched(reinstall, run), ampguard_log)


class HFAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, DIM)
        self.k_proj = nn.Linear(DIM, DIM)
        self.v_proj = nn.Linear(DIM, DIM)
        self.o_proj = nn.Linear(DIM, DIM)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        scores = q @ k.transpose(-1, -2) / math.sqrt(DIM)
        if attention_mask is not None:  # True: attend
            scores = scores.masked_fill(~attention_mask[:, None, :], torch.finfo(scores.dtype).min)
        return self.o_proj(scores.softmax(-1) @ v)


class HFMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = nn.Linear(DIM, 2 * DIM)
        self.down_proj = nn.Linear(2 * DIM, DIM)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(hidden_states)))


class HFLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(DIM)
        self.self_attn = HFAttention()
        self.post_attention_layernorm = nn.LayerNorm(DIM)
        self.mlp = HFMLP()

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        normed = self.input_layernorm(hidden_states)
        hidden_states = hidden_states + self.self_attn(hidden_states=normed, attention_mask=attention_mask)
        normed = self.post_attention_layernorm(hidden_states)
        return hidden_states + self.mlp(hidden_states=normed)


class HFModel(nn.Module):
    """An HF-style stack: every module below the root called with keyword inputs only."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(HFLayer() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attention_mask = x[..., 0] > -1.0  # padding, by the data
        attention_mask[:, 0] = True
        hidden_states = self.embed(input=x)
        for layer in self.layers:
            hidden_states = layer(hidden_states=hidden_states, attention_mask=attention_mask)
        return self.lm_head(input=self.norm(input=hidden_states).mean(1))


def test_an_hf_style_stack_called_with_keyword_inputs(reinstall, ampguard_log):
    def run() -> Result:
        torch.manual_seed(0)
        return fit(HFModel(), adamw=True)

    assert_trained_as_torch(*plain_then_watched(reinstall, run), ampguard_log)


@dataclass
class Evaluated:
    model: nn.Module
    scaler: Any
    outputs: list[torch.Tensor] = field(default_factory=list)


@pytest.mark.parametrize("where", ["between backward and step", "between steps"])
def test_an_evaluation_under_inference_mode_inside_a_watched_step(reinstall, ampguard_log, where: str):
    """An evaluation (eval mode, inference_mode, autocast) run inside each training step: after the backward pass,
    before ``scaler.step()`` (a callback of a trainer), or after ``update()``, before the next step's forward pass."""
    held_out = torch.Generator().manual_seed(99)
    val_x = torch.randn(8, 6, DIM, generator=held_out)

    def evaluate(run: Evaluated) -> None:
        run.model.eval()
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.float16):
            run.outputs.append(run.model(val_x))
        run.model.train()

    def run() -> Evaluated:
        model = healthy_net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        result = Evaluated(model, torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100))
        for step in range(STEPS):
            x, y = batch(step, healthy=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            result.scaler.scale(loss).backward()
            if where == "between backward and step":
                evaluate(result)
            result.scaler.step(optimizer)
            result.scaler.update()
            if where == "between steps":
                evaluate(result)
        return result

    reference, ours = plain_then_watched(reinstall, run)
    assert all(output.isfinite().all() for output in reference.outputs)
    assert ours.scaler.stats.fp32_islands == ()
    assert trouble(ampguard_log) == []
    assert len(ours.outputs) == len(reference.outputs) == STEPS
    assert all(torch.equal(theirs, mine) for theirs, mine in zip(reference.outputs, ours.outputs))
    assert all(torch.equal(theirs, mine) for theirs, mine in zip(reference.model.parameters(), ours.model.parameters()))
    assert ours.scaler.get_scale() == reference.scaler.get_scale()


# -- the watch never measures memory no op wrote ----------------------------------------------------------------

# glibc's mallopt(M_PERTURB, byte): every block malloc hands out (torch's CPU tensors are posix_memalign'd) is first
# filled with ``byte ^ 0xFF``; here 0x77, float16 0x7777 = 30,576. Freeing a float16 tensor of 30,000s just before
# the buffer, as a user's own code would leave it, lands on the buffer too seldom to test with: glibc's thread cache
# keeps a lone freed block away from 64-byte-aligned requests, and its first bytes are overwritten (measured here:
# 32 freed blocks before each buffer landed on 0 to 31 of 51 buffers, depending on what earlier tests left on the heap).
M_PERTURB = -6
POISON_BYTE = 0x77
POISON_BITS = 0x7777
POISON = 30576.0
# Buffers that must have held the poison as made, at least, for the test to mean anything (one would do). A block
# glibc hands out from its thread cache is not filled: measured here, 47 to 51 of 51.
POISONED_STEPS = 25


@pytest.fixture
def poisoned_allocator():
    """Every block the C allocator hands out holds float16 30,576s (until the test ends)."""
    libc = ctypes.CDLL(None)
    if platform.libc_ver()[0] != "glibc" or not hasattr(libc, "mallopt"):
        pytest.skip("poisons the allocator with glibc's mallopt(M_PERTURB)")
    assert int(torch.tensor(POISON_BITS, dtype=torch.int16).view(torch.float16)) == POISON
    if libc.mallopt(M_PERTURB, POISON_BYTE ^ 0xFF) != 1:
        pytest.skip("mallopt(M_PERTURB) was refused")
    try:
        yield
    finally:
        libc.mallopt(M_PERTURB, 0)


def mostly_poison(buffer: torch.Tensor) -> bool:
    return bool((buffer.view(torch.int16) == POISON_BITS).float().mean() >= 0.5)


class FreshBuffers(TorchDispatchMode):
    """The float16 buffers ``empty`` / ``empty_like`` / ``new_empty`` make inside Dropout's kernel, and how many hold
    mostly poison as made: the Dropout test's premise, checked with plain torch only (not stacked on the watch's
    own mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.made = 0
        self.poisoned = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        output = func(*args, **(kwargs or {}))
        if func.overloadpacket in FRESH and output.dtype == torch.float16:
            self.made += 1
            self.poisoned += mostly_poison(output)
        return output


FRESH = (torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.new_empty)


class Buffered(nn.Module):
    """A projection whose float16 output is written into a fresh buffer (or goes through a Dropout, whose kernel on
    the CPU makes its mask with ``empty_like`` + ``bernoulli_``), the allocator poisoned."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.dropout = nn.Dropout(0.25)
        self.dropout.register_forward_pre_hook(self._before_dropout)
        self.dropout.register_forward_hook(self._after_dropout)
        self.how = how
        self.poisoned = 0  # buffers that held mostly poison before they were written
        self.fresh: FreshBuffers | None = None  # with plain torch: Dropout's buffers, seen as the watch would see them

    def _before_dropout(self, module: nn.Module, args: tuple[torch.Tensor]) -> None:
        if self.fresh is not None:
            self.fresh.__enter__()

    def _after_dropout(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if self.fresh is not None:
            self.fresh.__exit__(None, None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if self.how == "Dropout":
            return self.dropout(h)
        if self.how == "empty_like":
            out = torch.empty_like(h)
        elif self.how == "empty":
            out = torch.empty(h.shape, dtype=h.dtype)
        else:
            out = h.new_empty(h.shape)
        self.poisoned += mostly_poison(out)
        sel = h[..., 0] > 0  # a dispatch: each half written by its own op, every value written
        out[sel] = h[sel] * 2
        out[~sel] = h[~sel] * 0.5
        return out


class PoisonNet(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.buffered = Buffered(how)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.buffered(self.embed(x)).mean(1))


@pytest.mark.usefixtures("poisoned_allocator")
@pytest.mark.parametrize("how", ["empty_like", "empty", "new_empty", "Dropout"])
def test_the_watch_never_measures_memory_no_op_wrote(reinstall, ampguard_log, how: str):
    """51 steps, 50 of them watched: no island, and no reading of the module anywhere near its real values' size
    (let alone the limit); and the weights of plain torch."""
    steps = 51
    readings: list[tuple[tuple[str, float], ...]] = []

    def run() -> Result:
        torch.manual_seed(0)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100)
        watched = isinstance(scaler, ampguard.SafeGradScaler)

        def after_update(step: int) -> None:
            if watched:
                readings.append(scaler.stats.headroom)

        model = PoisonNet(how)
        if not watched and how == "Dropout":
            model.buffered.fresh = FreshBuffers()
        torch.manual_seed(TRAIN_SEED)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        return train(steps, model=model, optimizer=optimizer, scaler=scaler, healthy=True, after_update=after_update)

    reference, ours = plain_then_watched(reinstall, run)
    # the test's premise: the buffers landed on the poison (Dropout's, made inside its kernel: seen with plain torch)
    if how == "Dropout":
        fresh = reference.model.buffered.fresh
        assert fresh is not None and fresh.made == steps and fresh.poisoned >= POISONED_STEPS
    else:
        assert reference.model.buffered.poisoned >= POISONED_STEPS
        assert ours.model.buffered.poisoned >= POISONED_STEPS
    assert len(readings) == steps and any(readings)  # the watch watched
    near = [
        (step, name, peak)
        for step, shown in enumerate(readings)
        for name, peak in shown
        if name.startswith("buffered") and peak >= SUSPECT
    ]
    assert near == []  # (step, module, peak) of each reading of the module near the limit
    assert_trained_as_torch(reference, ours, ampguard_log)


# -- bad data is not a module -----------------------------------------------------------------------------------

BAD_STEP = 5


@dataclass
class BadDataRun:
    lost: list[int]  # steps whose loss was not finite
    stats: Any
    tightest: list[tuple[str, float]]  # the watch's tightest module, by step


def train_with_bad_batch(value: float | None, steps: int = 10, fused: bool = False) -> BadDataRun:
    """tests/support/islands_support.py's net (``blocks.1.attn``'s logits within 64x of float16's limit on every batch, never
    past it) on healthy batches; at BAD_STEP one input value is ``value`` (None: no bad batch). ``fused``: a fused
    AdamW (the scaler's device mode), else SGD."""
    model = make_net()
    if fused:
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100)
    run = BadDataRun([], None, [])
    for step in range(steps):
        x, y = batch(step, healthy=True)
        if step == BAD_STEP and value is not None:
            x[0, 0, 0] = value  # a corrupt sample: the data's fault, no module's
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        if not torch.isfinite(loss):
            run.lost.append(step)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        headroom = scaler.stats.headroom
        run.tightest.append(headroom[0] if headroom else ("", 0.0))
    run.stats = scaler.stats
    return run


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=needs_fused_adam)], ids=["sgd", "fused-adamw"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_batch_with_non_finite_inputs_is_skipped_and_counted_and_makes_no_island(
    reinstall, ampguard_log, value, fused
):
    """Before the model's inputs were kept (ampguard/fp32_islands/model_inputs.py), blocks.1.attn, the module the
    watch saw closest, was blamed for the bad batch and made a permanent island."""
    reinstall(AMPGUARD_WATCH_EVERY="1")
    # the test's premise: without the bad batch, the watch sees blocks.1.attn close (a suspect), and nothing overflows
    control = train_with_bad_batch(None, fused=fused)
    assert control.lost == [] and control.stats.fp32_islands == ()
    assert all(name == "blocks.1.attn" and peak >= SUSPECT for name, peak in control.tightest[1:])
    reinstall(AMPGUARD_WATCH_EVERY="1")  # (islands are process state: start again)
    ampguard_log.clear()
    run = train_with_bad_batch(value, fused=fused)
    assert run.lost == [BAD_STEP]
    assert (run.stats.skipped, run.stats.nonfinite_loss) == (1, 1)
    assert run.stats.fp32_islands == ()
    said = [r.getMessage() for r in ampguard_log.records if "the batch itself held inf/NaN" in r.getMessage()]
    assert said == [messages.BAD_BATCH.format(step=BAD_STEP + 1)]
    assert not any("watching the next forward passes" in r.getMessage() for r in ampguard_log.records)
    assert not applied_healing().probe.armed
