"""The bench's model and its two training runs: torch's AMP objects against ampguard's.

One small transformer model is trained twice from the same weights on the same
batches:

* **torch**: torch's own ``GradScaler``, ``torch.autocast`` and
  ``clip_grad_norm_``, exactly as they are without ampguard (the original
  objects, reached through the wrappers ampguard installed: see
  :func:`torch_implementations`);
* **ampguard**: :class:`~ampguard.SafeGradScaler`, and ``torch.autocast`` and
  ``torch.nn.utils.clip_grad_norm_`` as the installed patches left them.

Both run the documented recipe (scale, backward, ``unscale_``, clip, step,
update). :mod:`.timing` times them, :mod:`.counting` counts their
synchronisations and ops, :mod:`.report` puts everything together.
"""

from __future__ import annotations

import copy
import os
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import ampguard
from ampguard.scaler import SafeGradScaler, TorchGradScaler

# Both scalers start from the same scale and grow alike, so both skip the same
# steps (torch's default of 65536 would skip early steps that ampguard's 1024 does not).
INIT_SCALE = 1024.0
GROWTH_INTERVAL = 100
MAX_NORM = 1.0
LEARNING_RATE = 1e-3
SEED = 0
DATA_BATCHES = 8  # distinct batches, cycled
COUNTED_STEPS = 4  # steps per variant in the sync-counting pass
CLIP_TENSORS = 100
CLIP_TENSOR_SHAPE = (64, 64)

_PACKAGE_DIR = os.path.dirname(os.path.abspath(ampguard.__file__)) + os.sep


@dataclass(frozen=True)
class ModelSpec:
    """The transformer the bench trains: token embedding, pre-norm encoder blocks, output head."""

    vocab: int
    d_model: int
    heads: int
    ff: int
    layers: int
    seq: int
    batch: int

    @classmethod
    def for_device(cls, device: str) -> ModelSpec:
        if device == "cuda":
            return cls(vocab=8192, d_model=512, heads=8, ff=2048, layers=4, seq=256, batch=16)
        return cls(vocab=1024, d_model=128, heads=4, ff=512, layers=2, seq=64, batch=8)


def default_dtype(device: str) -> str:
    """float16 on a GPU; bfloat16 on the CPU, where float16 matmuls have no fast kernel on most
    processors (0.4 GFLOP/s against 31 in float32 on the machine docs/performance.md was measured on)
    and would hide any overhead. The GradScaler recipe runs unchanged either way: the parameters and
    their gradients are float32, so the scaler and the clip do the same work."""
    return "float16" if device == "cuda" else "bfloat16"


def default_block_steps(device: str) -> int:
    """Steps per timed block: 1 on the CPU (the most pairs, the closest in time); 10 on a GPU, where
    each block ends with a synchronize that would otherwise keep the GPU's queue from filling."""
    return 10 if device == "cuda" else 1


@dataclass(frozen=True)
class Options:
    """What ``ampguard bench`` was asked to do."""

    device: str = "cpu"
    dtype: str = "bfloat16"  # autocast dtype: see default_dtype()
    steps: int = 300  # timed steps per variant (and per optimizer kind)
    block_steps: int = 1  # steps per timed block; the ratio is taken over paired blocks
    warmup_steps: int = 10  # untimed steps per variant before timing
    fused: bool = False  # also time a fused optimizer
    import_runs: int = 5  # fresh interpreters per import measurement (0: skip)
    clip_calls: int = 20  # calls per timed block of the clip measurement
    clip_blocks: int = 30  # paired blocks of the clip measurement
    model: ModelSpec | None = None  # None: ModelSpec.for_device(device)
    progress: Callable[[str], None] | None = None


# -- the two implementations -----------------------------------------------------------


def _in_ampguard(function: Any) -> bool:
    code = getattr(function, "__code__", None) if type(function) is types.FunctionType else None
    return code is not None and os.path.abspath(code.co_filename).startswith(_PACKAGE_DIR)


def is_ampguard_wrapper(obj: Any) -> bool:
    """Whether ``obj`` is a wrapper ampguard put around a torch object (``functools.wraps`` or wrapt)."""
    if type(obj) is types.FunctionType:
        return "__wrapped__" in vars(obj) and _in_ampguard(obj)
    # wrapt proxies forward __class__, __module__ and __code__ to the wrapped object; their wrapper is their own.
    # (a wrapt proxy keeps attributes named _self_* on itself, so this is the proxy's own wrapper).
    return _in_ampguard(getattr(obj, "_self_wrapper", None)) and hasattr(obj, "__wrapped__")


def unwrap_ampguard(obj: Any) -> Any:
    """``obj`` without ampguard's wrappers; torch's own decorators (``_no_grad``...) stay."""
    while is_ampguard_wrapper(obj):
        obj = obj.__wrapped__
    return obj


def pristine(cls: type) -> type:
    """``cls`` as torch defines it: a subclass undoing the wrappers ampguard put on its methods in place.

    ``cls`` itself when ampguard changed none of them.
    """
    originals = {name: unwrap_ampguard(value) for name, value in vars(cls).items() if is_ampguard_wrapper(value)}
    if not originals:
        return cls
    namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__, **originals}
    return type(cls.__name__, (cls,), namespace)


@dataclass(frozen=True)
class Implementation:
    """The three things a training step uses that ampguard may change."""

    name: str
    scaler_class: type
    autocast: Callable[..., Any]
    clip_grad_norm_: Callable[..., torch.Tensor]


def torch_implementations() -> Implementation:
    """torch's originals, whatever ampguard has wrapped or rebound."""
    return Implementation(
        name="torch",
        scaler_class=pristine(TorchGradScaler),
        autocast=pristine(torch.amp.autocast_mode.autocast),
        clip_grad_norm_=unwrap_ampguard(torch.nn.utils.clip_grad_norm_),
    )


def current_clip_grad_norm_(*args: Any, **kwargs: Any) -> torch.Tensor:
    # Looked up at every call, as a training script's `torch.nn.utils.clip_grad_norm_(...)` is.
    return torch.nn.utils.clip_grad_norm_(*args, **kwargs)


def ampguard_implementations() -> Implementation:
    """SafeGradScaler, and autocast and clip_grad_norm_ as the installed patches left them."""
    return Implementation(
        name="ampguard",
        scaler_class=SafeGradScaler,
        autocast=torch.autocast,
        clip_grad_norm_=current_clip_grad_norm_,
    )


def clip_is_wrapped() -> bool:
    return is_ampguard_wrapper(torch.nn.utils.clip_grad_norm_)


# -- the model and one training run ----------------------------------------------------


class TinyTransformer(torch.nn.Module):
    """A token embedding, ``layers`` pre-norm transformer encoder blocks and a linear head."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(spec.vocab, spec.d_model)
        block = torch.nn.TransformerEncoderLayer(
            spec.d_model, spec.heads, spec.ff, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.ModuleList([copy.deepcopy(block) for _ in range(spec.layers)])
        self.head = torch.nn.Linear(spec.d_model, spec.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        logits: torch.Tensor = self.head(hidden)
        return logits


def fused_unavailable_reason(device: str) -> str | None:
    """Why ``AdamW(fused=True)`` cannot run on ``device`` with this torch (None: it can)."""
    try:
        parameter = torch.nn.Parameter(torch.zeros(2, device=device))
        optimizer = torch.optim.AdamW([parameter], fused=True)
        parameter.grad = torch.zeros_like(parameter)
        optimizer.step()
    except Exception as error:  # the error text is the reason (e.g. CPU before torch 2.4)
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return None


class Run:
    """One variant training its own copy of the model: ``step()`` is one full AMP iteration."""

    def __init__(
        self,
        implementation: Implementation,
        model: torch.nn.Module,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        device: str,
        fused: bool,
        dtype: torch.dtype,
    ) -> None:
        self.implementation = implementation
        self.device = device
        self.dtype = dtype
        self.model = copy.deepcopy(model)
        # fused=None is torch's default (AdamW chooses); only fused=True is asked for.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE, fused=True if fused else None)
        self.scaler = implementation.scaler_class(device, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
        self.batches = batches
        self.index = 0

    def step(self) -> None:
        tokens, targets = self.batches[self.index % len(self.batches)]
        self.index += 1
        impl = self.implementation
        self.optimizer.zero_grad(set_to_none=True)
        with impl.autocast(self.device, dtype=self.dtype):
            logits = self.model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        impl.clip_grad_norm_(self.model.parameters(), MAX_NORM)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def steps(self, count: int) -> None:
        for _ in range(count):
            self.step()


def make_runs(options: Options, fused: bool) -> tuple[Run, Run]:
    """The torch run and the ampguard run: same initial weights, same batches."""
    spec = options.model or ModelSpec.for_device(options.device)
    generator = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    model = TinyTransformer(spec).to(options.device)
    batches = [
        (
            torch.randint(spec.vocab, (spec.batch, spec.seq), generator=generator).to(options.device),
            torch.randint(spec.vocab, (spec.batch, spec.seq), generator=generator).to(options.device),
        )
        for _ in range(DATA_BATCHES)
    ]
    dtype = getattr(torch, options.dtype)
    return (
        Run(torch_implementations(), model, batches, options.device, fused, dtype),
        Run(ampguard_implementations(), model, batches, options.device, fused, dtype),
    )


def optimizer_name(fused: bool) -> str:
    return "AdamW(fused=True)" if fused else "AdamW"


def same_parameters(first: torch.nn.Module, second: torch.nn.Module) -> bool:
    """Whether both runs ended with bit-identical weights (same work done: same steps skipped, same clip)."""
    return all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
