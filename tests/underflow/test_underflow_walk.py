"""What a sampled step hooks (ampguard.underflow.measure, issue 32): one node per module call's output, whatever
the calling convention, and the parameters' gradients once the backward pass is over.

Before, each module call walked the autograd graph it had built and hooked every node; the walks of modules
called HF's way (``self.self_attn(hidden_states=...)``) went down through every layer below (quadratic in depth),
and even made linear, a hook per node cost a sampled step 5-6x a healthy one on a model of small operations.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
from scaler_support import one_thread  # noqa: F401  (fixture)
from torch import nn

from ampguard.underflow.counts import Counts, read
from ampguard.underflow.measure import Sampler

pytestmark = pytest.mark.usefixtures("one_thread")

WIDTH = 16


def call(module: nn.Module, x: torch.Tensor, keyword: bool) -> torch.Tensor:
    """``module(x)``, or by keyword: HF's modules (``hidden_states=``), torch's own (``input=``)."""
    if not keyword:
        return module(x)
    return module(input=x) if type(module).__module__.startswith("torch.") else module(hidden_states=x)


class Attention(nn.Module):
    def __init__(self, keyword: bool) -> None:
        super().__init__()
        self.keyword = keyword
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = (call(p, hidden_states, self.keyword) for p in (self.q_proj, self.k_proj, self.v_proj))
        weights = torch.softmax(q @ k.transpose(-1, -2) / WIDTH**0.5, dim=-1)
        return call(self.o_proj, weights @ v, self.keyword)  # the matmuls between the projections: its own


class MLP(nn.Module):
    def __init__(self, keyword: bool) -> None:
        super().__init__()
        self.keyword = keyword
        self.up, self.act, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return call(self.down, call(self.act, call(self.up, hidden_states, self.keyword), self.keyword), self.keyword)


class Block(nn.Module):
    """Pre-norm attention, then an MLP fed the residual sum itself (a node the block makes, between its children)."""

    def __init__(self, keyword: bool) -> None:
        super().__init__()
        self.keyword = keyword
        self.norm, self.attn, self.mlp = nn.LayerNorm(WIDTH), Attention(keyword), MLP(keyword)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = hidden_states + call(self.attn, call(self.norm, hidden_states, self.keyword), self.keyword)
        return h + call(self.mlp, h * 0.5, self.keyword)


class Net(nn.Module):
    def __init__(self, depth: int, keyword: bool) -> None:
        super().__init__()
        self.keyword = keyword
        self.blocks = nn.ModuleList(Block(keyword) for _ in range(depth))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            hidden_states = call(block, hidden_states, self.keyword)
        return call(self.head, hidden_states, self.keyword)


def net(depth: int, keyword: bool) -> Net:
    torch.manual_seed(0)
    return Net(depth, keyword)


def sample(model: nn.Module, x: torch.Tensor, sampler: Sampler | None = None) -> dict[str, Counts]:
    """One sampled float16-autocast forward and backward; the counts per module."""
    sampler = sampler or Sampler()
    sampler.arm()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().pow(2).mean()
    loss.backward()  # zeros and subnormals to count, as well as normal values
    sampler.count_parameters(model.parameters())
    measurement, _ = read(sampler.finish(), step=2, scale=1.0)
    return dict(measurement.modules)


def gradients_counted(depth: int, keyword: bool) -> int:
    """The gradients a sampled step of ``net(depth, keyword)`` hands to its sample."""
    sampler = Sampler()
    sampler.arm()
    model = net(depth, keyword)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(inputs()).float().pow(2).mean()
    loss.backward()
    sampler.count_parameters(model.parameters())
    return len(sampler.finish().entries)


def inputs() -> torch.Tensor:
    return torch.randn(2, 6, WIDTH, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("depth", [1, 3])
def test_a_model_calling_by_keyword_measures_what_the_same_model_calling_positionally_does(depth):
    positional = sample(net(depth, keyword=False), inputs())
    keyword = sample(net(depth, keyword=True), inputs())
    # The modules with float16 gradients (under autocast the norms and the residual stream are float32).
    assert {"head", f"blocks.{depth - 1}.attn.o_proj", f"blocks.{depth - 1}.mlp.up"} <= set(positional)
    assert any(counts.zeros for counts in positional.values())  # the ReLU's
    assert any(counts.below_normal > counts.zeros for counts in positional.values())  # subnormals
    assert keyword == positional


@pytest.mark.parametrize("keyword", [False, True], ids=["positional", "keyword"])
def test_a_sampled_step_counts_a_number_of_gradients_linear_in_depth(keyword):
    """One gradient per module call's output and per parameter, whatever the calling convention: each block adds
    the same number (its cost: one node hook per module call, no walk of the graph). Before issue 32 the walks of
    keyword calls visited a number of nodes quadratic in depth (14x from 4 to 16 blocks)."""
    counts = [gradients_counted(depth, keyword) for depth in (4, 8, 16)]
    per_block = (counts[1] - counts[0]) // 4
    assert counts[1] - counts[0] == 4 * per_block and counts[2] - counts[1] == 8 * per_block
    # per block: the outputs of the block, the norm, q/k/v/o projections, the ReLU, up and down (the attention's
    # and the MLP's are their last projection's, counted there; the block's and the norm's, float32, only tell
    # whether a flush went on through them) and the weights and biases of the 6 projections (float16-made)
    assert per_block == 9 + 12
    assert gradients_counted(16, keyword) == counts[2]  # counted, not timed: the same every time


class InThreads(nn.Module):
    """Casts its input to float16 (a node it makes, counted in it), then runs a model on each half of the batch in
    a thread of its own, as ``nn.DataParallel`` runs its replicas (autocast entered again in each thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(WIDTH))
        self.models = nn.ModuleList([net(2, keyword=False), net(2, keyword=False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def run(model: nn.Module, half: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.float16):
                return model(half)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            return torch.cat(list(pool.map(run, self.models, (x * self.gain).half().chunk(2))))


def test_module_calls_in_worker_threads_are_measured_in_their_modules():
    """Replicas run in threads (as ``nn.DataParallel`` runs them): each thread's calls nest in its own depth, and
    the wrapper's output and parameter are counted in the wrapper."""
    now = sample(InThreads(), inputs())
    assert now["InThreads"].values == 2 * 6 * 4 + WIDTH  # the outputs' concatenation, the gain's gradient
    assert "models.0.blocks.1.mlp.up" in now and "models.1.blocks.1.mlp.up" in now
    alone = sample(net(2, keyword=False), inputs()[:1])["blocks.1.mlp.up"]
    assert now["models.0.blocks.1.mlp.up"].values == alone.values
