"""The sampled step: hooks that count one backward pass's float16 gradients, per module.

Armed for one optimizer step (:meth:`Sampler.arm`), a global module forward
hook registers a pre-hook on the autograd node of each module call's outputs:
the gradient of a module's output is counted when the backward pass reaches it,
in the innermost module that returned it (children finish their forward before
their parent; a node hooked is marked in its own ``metadata``). The gradients
of the parameters float16 made are counted when their scaler is about to
unscale them (:meth:`Sampler.count_parameters`): float16 parameters', and
float32 ones' of modules whose output was float16 (autocast cast them: their
gradient holds the float16 copy's values). So a sample counts what flows
between modules and what reaches the update; the gradients inside a module
(between an attention's projections) are not counted, which keeps a sampled
step to one hook per module call and output, and no walk of the graph.

Each gradient goes to :class:`~ampguard.underflow.gradients.Gradients`,
counted a batch at a time on the device; float32 gradients of module outputs
are counted too, to tell whether a flush went on through them
(:mod:`ampguard.underflow.flushes`). Nothing is changed: the hooks return
nothing, and an error inside them ends the sample (reported once), never the
step. Healthy steps run none of this: the hooks exist only between
:meth:`Sampler.arm` and :meth:`Sampler.finish`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

import ampguard.containment as containment
import ampguard.underflow.nodes as node_kinds
from ampguard.module_hooks import GlobalModuleHooks
from ampguard.torch_privates import in_functorch_transform
from ampguard.underflow.gradients import Gradients


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


# The node whose pre-hook runs (torch 2.3 to 2.14; without it the sample keeps no node, and every all-zero gradient
# is judged by the step alone: ampguard.underflow.flushes).
_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)


def _when_backward_completes(callback: Callable[[], None]) -> None:
    """``callback`` at the end of the backward pass running now, if it completes (autograd's final callbacks,
    which DistributedDataParallel uses too; torch 2.3 to 2.14). Without them, entries keep their nodes."""
    engine = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is not None:
        queue(callback)


# The backward pass (graph task) this thread runs, -1 outside one (torch 2.3 to 2.14; without it every backward
# pass is one, -1: a sample counts every backward pass through the nodes it hooked, as before).
_current_task: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)


class _Count:
    """A node hook of one module call: hands the gradients to :meth:`Sampler.count` (holds no node)."""

    __slots__ = ("sampler", "session", "slot", "within")

    def __init__(self, sampler: Sampler, slot: int, session: int, within: int) -> None:
        self.sampler, self.slot, self.session, self.within = sampler, slot, session, within

    def __call__(self, gradients: tuple[torch.Tensor | None, ...]) -> None:
        self.sampler.count(self.slot, self.session, self.within, gradients)


class Sampler:
    """Owns one sampled step: its hooks while armed, its gradients' counts until finished.

    An armed sampler that is never finished (its scaler dropped, training over
    with the sample due) disarms itself after :data:`MAX_CALLS` outermost module
    calls without a backward pass through the sample between them: it never
    keeps hooking module calls. A validation that long drops the sample (the listener
    tries again at the next scheduled step).

    Armed for a scaler (``own_losses``), it counts only the backward passes of
    the losses that scaler scaled (:meth:`own_loss`): another model's backward
    pass, scaled by another scaler (a GAN's other half), reaches the nodes it
    hooked but is not counted, and its parameters are counted only for the
    scaler's own optimizer.
    """

    MAX_CALLS = 1024  # a forward pass that is no module call itself may make a few hundred (a loop over layers)

    def __init__(self) -> None:
        self.gradients = Gradients()  # this sample's
        self._mark = f"ampguard.underflow.{id(self)}"  # node.metadata key: the session that hooked the node
        # The node hooks' handles, removed when the sample ends: a node kept across samples (a parameter's
        # accumulator, which DistributedDataParallel keeps) carries no hook between them.
        self._node_hooks: list[Any] = []
        self._calls = 0  # outermost module calls since armed, or since the sample's last backward
        # Per thread (``depth``): the module calls in progress (another thread's module calls are not this
        # thread's children).
        self._calls_in_progress = threading.local()
        self._names: dict[int, str] = {}  # id(module) -> qualified name in the outermost module called
        self._owners: dict[int, int] = {}  # id(parameter) -> id(the module whose own it is)
        self._half: set[int] = set()  # id(module) of the calls that returned a float16 tensor, this sample
        self._called: set[int] = set()  # id(module) of the calls seen returning a tensor with a gradient, this sample
        self._optimizers_counted: set[int] = set()  # id(optimizer), this sample
        self._session = 0  # node hooks of an earlier sample (a retained graph) do nothing
        self._own_losses = False  # count only the backward passes (graph tasks) in _tasks
        self._tasks: set[int] = set()  # those of the losses given to own_loss, this sample
        self._tasks_followed: set[int] = set()  # the backward passes whose completion the sample listens for
        self._seen_call = False  # a module call's output was hooked, this sample
        # always_call: a forward that raises (a batch skipped after an out-of-memory error) still leaves its depth,
        # so later calls are known as outermost again
        self._hooks = GlobalModuleHooks(self._pre_forward, self._post_forward)

    @property
    def armed(self) -> bool:
        return self._hooks.armed

    def arm(self, own_losses: bool = False) -> None:
        """Hooks on for the next forward and backward passes; ``own_losses``: count only the backward passes of the
        losses given to :meth:`own_loss` (else every backward pass through the nodes hooked)."""
        if self.armed:
            return
        self._session += 1
        self._remove_node_hooks()  # (a sample dropped before its finish)
        self.gradients, self._names, self._calls_in_progress = Gradients(), {}, threading.local()
        self._owners, self._half, self._called, self._optimizers_counted = {}, set(), set(), set()
        self._own_losses, self._tasks, self._tasks_followed = own_losses, set(), set()
        self._seen_call = False
        self._calls = 0
        self._hooks.arm()

    def own_loss(self, scaled: Any) -> None:
        """``scaled`` (a tensor or a container of them) is a loss of this sample's scaler: the backward passes
        started from it are counted. Its node, the first its backward pass runs, records that pass (graph task)
        when reached; backward passes nested in it (a reentrant checkpoint's) are counted through the module
        calls recomputed inside it (:meth:`_count`). A loss of a model whose module calls the sample did not see
        (``model.compile()``: they ran compiled) is said to be stepped aside here."""
        session = self._session

        def record(gradients: tuple[torch.Tensor | None, ...]) -> None:
            if session == self._session:
                self._tasks.add(_current_task())

        try:
            if isinstance(scaled, Iterator):  # (torch's scale() maps an iterator lazily: nothing to look at)
                node_kinds.step_aside_lazy_losses()
            for tensor in _tensors(scaled):
                if tensor.grad_fn is not None:
                    self._node_hooks.append(tensor.grad_fn.register_prehook(record))
                    if not self._seen_call:
                        node_kinds.step_aside_unseen()
        except Exception as error:
            self._fail("scaled loss", error)

    def disarm(self) -> None:
        """No more hooks on module calls; node hooks already registered stay until their graph is freed."""
        self._hooks.disarm()

    def _remove_node_hooks(self) -> None:
        """Never from a node hook: the backward pass may be iterating the hooks of that node."""
        for hook in self._node_hooks:
            hook.remove()
        self._node_hooks = []

    def _fail(self, where: str, error: Exception) -> None:
        """ampguard's own error inside a hook: reported once, the sample dropped, the step goes on."""
        self.disarm()
        self._session += 1  # the node hooks already registered do nothing
        self.gradients = Gradients()
        containment.report(f"underflow sample ({where})", error)

    # (Both run through GlobalModuleHooks' eager_only: never while dynamo traces.)
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if in_functorch_transform():  # (the forward hook returns here too: the call depth stays as it is)
            node_kinds.step_aside_transformed()
            return
        try:
            self._enter(module)
        except Exception as error:
            self._fail("module forward pre-hook", error)

    def _enter(self, module: nn.Module) -> None:
        local = self._calls_in_progress  # (per thread: another thread's module calls are not this one's children)
        depth: int = getattr(local, "depth", 0)
        local.depth = depth + 1
        if depth == 0:
            if _current_task() == -1:  # a new forward pass, not a recomputation inside a backward pass
                self.gradients.let_go_of_unfinished()
            self._calls += 1
            if self._calls > self.MAX_CALLS:  # nobody finishes this sample
                self.disarm()
                self.gradients = Gradients()
                return
            if id(module) not in self._names:
                for name, child in module.named_modules():
                    self._names.setdefault(id(child), name or type(module).__name__)
                    for parameter in child.parameters(recurse=False):
                        self._owners.setdefault(id(parameter), id(child))

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.armed or in_functorch_transform():
            return
        try:
            self._leave(module, output)
        except Exception as error:
            self._fail("module forward hook", error)

    def _leave(self, module: nn.Module, output: Any) -> None:
        local = self._calls_in_progress
        local.depth = max(getattr(local, "depth", 0) - 1, 0)
        if not torch.is_grad_enabled():
            return
        outputs = [output] if type(output) is torch.Tensor else list(_tensors(output))
        nodes: list[Any] = [t.grad_fn for t in outputs if t.grad_fn is not None]
        if not nodes:
            return
        self._seen_call = True
        slot = id(module)
        if slot not in self._names:  # (called outside the outermost module's tree)
            self._names[slot] = type(module).__name__
        count = self._counter(slot, _current_task())
        mark, session, hooks = self._mark, self._session, self._node_hooks
        compiled = False
        for node in nodes:
            metadata = node.metadata
            if metadata.get(mark) == session or self._views_of_counted(node):  # a child's output (or a view of
                continue  # it, at any depth), or an output returned twice: counted there
            metadata[mark] = session
            if type(node).__name__ in node_kinds.COMPILED_NODE_KINDS:  # (its output's few values would stand
                node_kinds.step_aside_compiled(module, self._names[slot])  # for the region: not counted)
                compiled = True
                continue
            hooks.append(node.register_prehook(count))  # (the handle holds no node)
        if not compiled:
            self._called.add(slot)
        if any(t.dtype == torch.float16 for t in outputs):
            self._half.add(slot)

    def _views_of_counted(self, node: Any) -> bool:
        """Whether ``node`` is a view (of a view ...) of a node hooked already: its gradient holds the same values."""
        mark, session = self._mark, self._session
        while type(node).__name__ in node_kinds.SAME_VALUES:
            following = node.next_functions
            node = following[0][0] if following else None
            if node is None:
                return False
            if node.metadata.get(mark) == session:
                return True
        return False

    def count_parameters(self, optimizer: torch.optim.Optimizer | Iterable[torch.Tensor]) -> None:
        """Count the gradients of ``optimizer``'s parameters (or of the parameters given) whose values float16 made,
        still scaled (its scaler is about to unscale them): float16 parameters', and float32 ones' of modules whose
        output was float16 in the sampled forward pass (autocast ran them in float16, so their parameters were
        cast: the gradients are the float16 copies' values). A float32 module under autocast (a LayerNorm)
        computes its parameters' gradients in float32: not counted; nor are the parameters of a module the sample
        did not see called (compiled, or outside the model). Each optimizer once a sample (at its first unscale:
        gradient accumulation unscales once, at the end)."""
        if id(optimizer) in self._optimizers_counted or (self._own_losses and not self._tasks):
            return  # (counted already; or no loss of its scaler reached the sample: nothing of this step is counted)
        self._optimizers_counted.add(id(optimizer))
        try:
            sample = self.gradients
            groups = optimizer.param_groups if isinstance(optimizer, torch.optim.Optimizer) else [{"params": optimizer}]
            for group in groups:
                for parameter in group["params"]:
                    gradient = parameter.grad
                    slot = self._owners.get(id(parameter))
                    if slot not in self._called or not node_kinds.dense(gradient):
                        continue
                    if parameter.dtype == torch.float16 or (parameter.dtype == torch.float32 and slot in self._half):
                        if slot not in sample.names:
                            sample.names[slot] = self._names.get(slot, "?")
                        sample.add(slot, None, gradient, True, parameter=True)
            sample.count_now()  # (the scaler unscales them in place next)
        except Exception as error:
            self._fail("parameters' gradients", error)

    def _counter(self, slot: int, within: int) -> _Count:
        return _Count(self, slot, self._session, within)

    def count(self, slot: int, session: int, within: int, gradients: tuple[torch.Tensor | None, ...]) -> None:
        """Hand the node's gradients to the sample: float16 ones counted, float32 ones of
        module outputs (under autocast: the residual stream its float16 branches are cast from) kept to tell
        whether a flush went on through them. Armed for a scaler, only in its losses' backward passes, or in one
        nested in them (``within``: the backward pass the module call ran in, -1: none)."""
        if session != self._session:
            return
        if self._own_losses and within not in self._tasks and _current_task() not in self._tasks:
            return
        if in_functorch_transform():  # a hooked graph differentiated again inside vmap (is_grads_batched, jacrev)
            node_kinds.step_aside_transformed()
            return
        self._calls = 0  # a backward pass through the sample: training goes on
        try:
            node = _current_node()
            sample = self.gradients
            task = _current_task()
            if node is not None and task not in self._tasks_followed:
                self._tasks_followed.add(task)
                _when_backward_completes(self._finished_callback(task, session))
            for gradient in gradients:
                if not node_kinds.dense(gradient):
                    continue
                counted = gradient.dtype == torch.float16
                if counted or sample.counted:
                    if slot not in sample.names:
                        sample.names[slot] = self._names.get(slot, "?")
                    sample.add(slot, node, gradient, counted, task=task)
        except Exception as error:
            self._fail("backward node hook", error)

    def _finished_callback(self, task: int, session: int) -> Callable[[], None]:
        def finished() -> None:  # (autograd runs it at the end of a backward pass that completed)
            if session == self._session:
                self.gradients.finished(task)

        return finished

    def finish(self) -> Gradients:
        """End the sample: no more counting; its gradients, to :func:`~ampguard.underflow.counts.read`."""
        self.gradients.let_go_of_unfinished()
        self.disarm()
        self._session += 1
        self._remove_node_hooks()
        gradients, self.gradients = self.gradients, Gradients()
        return gradients
