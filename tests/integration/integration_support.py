"""Shared pieces of the integration tests (see README.md in this folder); imported as ``integration_support``.

* :func:`require`: import a trainer library or skip the whole module with a
  reason that says what is missing or why it does not import;
* :class:`OverflowInjector`: makes one parameter's gradient inf on chosen
  backward passes, the way an fp16 overflow looks to a GradScaler;
* :func:`stock_torch`: a block run with ampguard uninstalled (torch's own
  GradScaler), for "what would the library see with torch's scaler";
* :func:`run_python`: a fresh interpreter for import-order tests and examples;
* :func:`note_new_sample`: the underflow patch's last measurement, for the scripts that record each sample.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import ampguard

# No hub downloads, no telemetry, no dashboards: every model is built from a config.
for _variable, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "disabled",
    "PL_DISABLE_FORK": "1",
}.items():
    os.environ.setdefault(_variable, _value)

REPO = Path(__file__).resolve().parents[2]
INSTALL_HINT = "pip install -e '.[integration]' (see tests/integration/README.md)"
# What the underflow measurement scripts keep of each sample (``scaler.stats``), some under a shorter name.
SAMPLE_FIELDS = ("underflow_step", "underflow_share", "underflow_subnormal", "underflow_lost", "underflow_grad_peak")
SAMPLE_KEYS = {"underflow_scale": "scale", "underflow_modules": "modules"}


def require(name: str) -> ModuleType:
    """Import ``name`` or skip the calling test module with a clear reason.

    ``pytest.importorskip`` covers a library that is not installed. A library
    that is installed but cannot load (torchvision built for another torch
    raises RuntimeError "operator torchvision::nms does not exist", which also
    breaks ``import lightning`` and ``import timm``) is skipped too, with the
    error in the reason, instead of failing collection.
    """
    try:
        return pytest.importorskip(name, reason=f"{name} is not installed: {INSTALL_HINT}", exc_type=ImportError)
    except Exception as error:  # pytest's Skipped is not an Exception: it passes through
        pytest.skip(
            f"{name} is installed but does not import next to torch {torch.__version__} "
            f"({type(error).__name__}: {error}); {INSTALL_HINT}",
            allow_module_level=True,
        )


class OverflowInjector:
    """Makes ``param``'s gradient inf on the backward passes numbered in ``at`` (0-based).

    A tensor hook on the parameter sees every backward pass that reaches it,
    whichever library runs the backward (``scaler.scale(loss).backward()``,
    ``accelerator.backward``, Lightning's closure), so the overflow arrives
    exactly where a real fp16 overflow would: in the gradients the scaler
    unscales.
    """

    def __init__(self, param: torch.nn.Parameter, at: Iterable[int]) -> None:
        self.at = frozenset(at)
        self.backward_passes = 0
        self.injected = 0
        self._handle = param.register_hook(self._hook)

    def _hook(self, grad: torch.Tensor) -> torch.Tensor | None:
        index = self.backward_passes
        self.backward_passes += 1
        if index in self.at:
            self.injected += 1
            return torch.full_like(grad, float("inf"))
        return None

    def remove(self) -> None:
        self._handle.remove()


@contextlib.contextmanager
def stock_torch() -> Iterator[None]:
    """torch exactly as without ampguard inside the block (the autouse fixture reinstalls too)."""
    ampguard.uninstall()
    try:
        yield
    finally:
        ampguard.install()


def torch_grad_scaler(**settings: Any) -> Callable[..., Any]:
    """torch's own GradScaler class with these settings, ampguard installed or not.

    Built on demand, never kept in a module global: ampguard's install rebinds
    every module global (and partial) that holds torch's class, test modules included.
    """
    import ampguard.scaler

    return functools.partial(ampguard.scaler.TorchGradScaler, **settings)


def assert_safe(scaler: Any, *, init_scale: float = 1024.0, growth_interval: int = 100) -> None:
    """``scaler`` is a SafeGradScaler with ampguard's settings (an enabled one)."""
    assert isinstance(scaler, ampguard.SafeGradScaler), type(scaler)
    assert scaler.is_enabled()
    assert scaler._init_scale == init_scale
    assert scaler.get_growth_interval() == growth_interval


@contextlib.contextmanager
def cuda_reported_available(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Inside the block torch believes CUDA is there, so that a library's
    ``GradScaler("cuda")`` comes out enabled and shows its settings. Nothing in
    the block may touch a CUDA tensor: GradScaler allocates on first ``scale()``.
    """
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        yield


def run_python(
    args: list[str], *, cwd: Path | str | None = None, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in a fresh interpreter (this one's), ampguard's env cleared except AMPGUARD_QUIET."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")}
    environment["AMPGUARD_QUIET"] = "1"
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environment.get("PYTHONPATH", "")]))
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, *args], cwd=cwd or REPO, env=environment, capture_output=True, text=True, timeout=timeout
    )


def assert_ran(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def note_new_sample(stats: dict[str, Any], samples: list[dict[str, Any]]) -> None:
    """Appends the scaler's last measurement (``stats``: ``scaler.stats.as_dict()`` after an update) to
    ``samples`` when it is one more than they hold, with the scale the sampled step ran at."""
    if stats["underflow_samples"] > len(samples):
        sample = {key: stats[key] for key in SAMPLE_FIELDS}
        samples.append(sample | {name: stats[key] for key, name in SAMPLE_KEYS.items()})


def samples_text(samples: list[dict[str, Any]]) -> str:
    """``samples`` (as :func:`note_new_sample` keeps them) for a table: "step: share, lost share (scale)", ...;
    "-": none."""
    return (
        ", ".join(
            f"{s['underflow_step']}: {s['underflow_share']:.2%}, lost {s['underflow_lost']:.2%} ({s['scale']:g})"
            for s in samples
        )
        or "-"
    )
