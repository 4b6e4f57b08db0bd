"""The module a user holds: the top-level module above any module, found by one scan of live objects.

A module knows its children, not its parents, and the outermost module a
forward pass calls is often not the object a script holds: coqui's recipe
calls ``GPTTrainer.xtts`` while the script holds the ``GPTTrainer``, timm's
train.py calls its task (which holds the model as ``trainable_module``) and the
model itself. fp32 island names are qualified from the *top-level* module, the
outermost one that holds the module and, where several do, the one that holds
parameters an optimizer trains; that is the object ``model.get_submodule(name)``
works on.

:func:`scan` finds every live module and optimizer with one pass over the
garbage collector's objects (no host read; :mod:`ampguard.live_objects`). It runs on the failure path only:
when the probe names a module, and once when a checkpoint's islands are
re-applied; never on a healthy step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ampguard.live_objects import instances


@dataclass
class ModelTree:
    """Who holds whom among the live modules, and which parameters optimizers train."""

    parents: dict[int, list[torch.nn.Module]] = field(default_factory=dict)
    trained: set[int] = field(default_factory=set)  # id() of every parameter some live optimizer holds
    tops: list[torch.nn.Module] = field(default_factory=list)  # modules no other module holds

    def top_level(self, module: torch.nn.Module, called: torch.nn.Module | None = None) -> torch.nn.Module:
        """The outermost module holding ``module`` (``module`` itself when none does).

        A module held by several trees (a block shared with a teacher) has
        several: ``called`` (the module the training loop called) when it is one
        of them and holds trained parameters, else the one holding the most
        parameters an optimizer trains (the student, not a teacher that only shares its blocks).
        """
        tops: list[torch.nn.Module] = []
        seen: set[int] = set()
        frontier = [module]
        while frontier:
            current = frontier.pop()
            if id(current) in seen:
                continue
            seen.add(id(current))
            holders = self.parents.get(id(current))
            if holders:
                frontier.extend(holders)
            else:
                tops.append(current)
        trained = [top for top in tops if self.holds_trained(top)]
        if called is not None and any(top is called for top in trained):
            return called
        if trained:
            return max(trained, key=self.trained_count)  # the first of the largest
        return (tops or [module])[0]

    def trained_tops(self) -> list[torch.nn.Module]:
        """The top-level modules that hold parameters some optimizer trains (the models being trained)."""
        return [top for top in self.tops if self.holds_trained(top)]

    def holds_trained(self, module: torch.nn.Module) -> bool:
        return any(id(p) in self.trained for p in module.parameters())

    def trained_count(self, module: torch.nn.Module) -> int:
        return sum(id(p) in self.trained for p in module.parameters())


def scan() -> ModelTree:
    """Every live module's holders and every live optimizer's parameters (one pass over gc's objects)."""
    tree = ModelTree()
    modules: list[torch.nn.Module] = []
    for obj in instances(torch.nn.Module, torch.optim.Optimizer):
        kind = type(obj)  # not isinstance: it reads __class__, which some objects warn or raise on
        if issubclass(kind, torch.nn.Module):
            modules.append(obj)
        elif issubclass(kind, torch.optim.Optimizer):
            tree.trained.update(id(p) for group in obj.param_groups for p in group["params"])
    for module in modules:
        for child in module._modules.values():
            if child is not None and child is not module:
                tree.parents.setdefault(id(child), []).append(module)
    tree.tops = [module for module in modules if id(module) not in tree.parents]
    return tree
