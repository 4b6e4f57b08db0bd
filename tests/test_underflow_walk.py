"""The sampled step's graph walk (ampguard.underflow.measure, issue 32): where each module call's walk ends.

A module call's walk goes from its outputs down to the nodes made before the call began (its inputs, whether
they came by position or by keyword) and hooks the nodes it made that no module inside it hooked. Before, only
the nodes of positional inputs ended a walk (global forward pre-hooks see no keyword arguments): a module called
HF's way (``self.self_attn(hidden_states=...)``) walked down through every layer below it, so a sampled step's
walks visited a number of nodes quadratic in depth, and a keyword call counted its caller's nodes as its own.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import pytest
import torch
from scaler_support import one_thread  # noqa: F401  (fixture)
from torch import nn
from underflow_support import AttentionNet, batches

import ampguard.underflow.measure as measure
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
    measurement, _ = read(sampler.finish(), step=2, scale=1.0)
    return dict(measurement.modules)


def inputs() -> torch.Tensor:
    return torch.randn(2, 6, WIDTH, generator=torch.Generator().manual_seed(1))


class Before(Sampler):
    """The walk of before, for reference: each call walks from its outputs down to its positional inputs' nodes,
    through everything its children walked."""

    def _leave(self, module: nn.Module, output: Any) -> None:
        in_progress = self._inputs()
        call = in_progress.pop() if in_progress else None
        nodes = [t.grad_fn for t in measure._tensors(output) if t.grad_fn is not None]
        if torch.is_grad_enabled() and nodes:
            self._hook_graph(module, nodes, call.inputs if call else set(), None, {})


def walked(depth: int, keyword: bool, sampler: Sampler | None = None) -> int:
    """The nodes a sampled step's walks visit."""
    sampler = sampler or Sampler()
    before = sampler.walked
    sample(net(depth, keyword), inputs(), sampler)
    return sampler.walked - before


@pytest.mark.parametrize("depth", [1, 3])
def test_a_model_calling_by_keyword_measures_what_the_same_model_calling_positionally_does(depth):
    positional = sample(net(depth, keyword=False), inputs())
    keyword = sample(net(depth, keyword=True), inputs())
    # The modules with float16 gradients (under autocast the norms and the residual stream are float32).
    assert {"head", f"blocks.{depth - 1}.attn", f"blocks.{depth - 1}.mlp.up"} <= set(positional)
    assert any(counts.zeros for counts in positional.values())  # the ReLU's
    assert any(counts.below_normal > counts.zeros for counts in positional.values())  # subnormals
    assert keyword == positional


def test_before_a_keyword_call_counted_its_callers_nodes_as_its_own():
    """The walk of before told the two apart: the attention's own matmuls, its output projection's keyword input,
    were counted in the projection."""
    positional = sample(net(2, keyword=False), inputs(), Before())
    keyword = sample(net(2, keyword=True), inputs(), Before())
    assert sum(c.values for c in keyword.values()) == sum(c.values for c in positional.values())
    assert "blocks.1.attn" in positional and "blocks.1.attn" not in keyword
    assert keyword["blocks.1.attn.o_proj"].values == (
        positional["blocks.1.attn.o_proj"].values + positional["blocks.1.attn"].values
    )


def graph_size(model: nn.Module) -> int:
    """The nodes of the model's autograd graph."""
    with torch.autocast("cpu", dtype=torch.float16):
        stack = [model(inputs()).grad_fn]
    nodes = set()
    while stack:
        node = stack.pop()
        if node is not None and node not in nodes:
            nodes.add(node)
            stack.extend(next_node for next_node, _ in node.next_functions)
    return len(nodes)


def measured(model: str, sampler: Sampler) -> dict[str, Counts]:
    if model == "attention_net":
        torch.manual_seed(0)
        tokens, _ = batches(1)[0]
        return sample(AttentionNet(), tokens, sampler)
    return sample(net(2, keyword=model == "keyword_net"), inputs(), sampler)


@pytest.mark.parametrize("model", ["attention_net", "positional_net"])
def test_a_positional_model_measures_as_before(model):
    """For modules that take their input by position, the tallies per module are those of the walk of before."""
    assert measured(model, Sampler()) == measured(model, Before())


@pytest.mark.parametrize("model", ["positional_net", "keyword_net"])
def test_without_autograds_sequence_numbers_the_walk_is_that_of_before(monkeypatch, model):
    """A torch without ``torch._C._autograd._get_sequence_nr``: positional inputs alone end a walk (keyword calls
    then cost what they did)."""
    monkeypatch.setattr(measure, "_next_sequence_nr", None)
    assert measured(model, Sampler()) == measured(model, Before())


@pytest.mark.parametrize("keyword", [False, True], ids=["positional", "keyword"])
def test_a_sampled_steps_walk_visits_a_number_of_nodes_linear_in_depth(keyword):
    """Four times the blocks, four times the nodes visited: each node once, by the innermost call that made it,
    and each call's boundary nodes once more. The walk of before, with keyword calls: quadratic (14x here)."""
    small, large = walked(4, keyword), walked(16, keyword)
    assert 3.6 * small < large < 4.2 * small
    assert walked(16, keyword) == large  # counted, not timed: the same every time
    assert large < 1.5 * graph_size(net(16, keyword))  # (1193 nodes, 1545 visits)
    before_small, before_large = walked(4, keyword, Before()), walked(16, keyword, Before())
    assert before_large > (12 if keyword else 3.6) * before_small and before_large > 2.5 * large


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


def test_module_calls_in_worker_threads_are_measured_as_before():
    """autograd numbers nodes per thread: a call during which another thread entered or left a module call ends
    its walk at its positional inputs only, as before (the wrapper's walk goes down through the threads' nodes to
    the cast it made), and so measures as before."""
    node = torch.zeros((), requires_grad=True)
    for _ in range(2000):  # this thread's numbers run ahead of the fresh worker threads': those seem made before
        node = node * 1.0
    now = sample(InThreads(), inputs())
    assert now["InThreads"].values == 2 * 6 * WIDTH + 2 * 6 * 4  # the cast's, and the outputs' concatenation's
    assert "models.0.blocks.1.mlp.up" in now and "models.1.blocks.1.mlp.up" in now
    assert sample(InThreads(), inputs(), Before()) == now
