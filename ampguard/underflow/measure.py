"""The sampled step: hooks that count one backward pass's float16 gradients, per module.

Armed for one optimizer step (:meth:`Sampler.arm`), a global module forward
hook walks the autograd graph each module call just built and registers a
pre-hook on every node found: the node's incoming gradient (the gradient of
the tensor that op produced, or for a leaf's accumulator the leaf's gradient)
is counted when the backward pass reaches it, if it is float16. Every gradient
is counted once, in the innermost module whose output led to it (children
finish their forward before their parent): a node hooked is marked in its own
``metadata``, so the sample holds no node and no graph. The gradients of
float16 weight copies (autocast's casts) are counted with the module that cast
them, those of float16 parameters with the module that used them. Nothing is
changed: the hooks return nothing, and an error inside them ends the sample
(reported once), never the step.

The counts (:class:`~ampguard.underflow.counts.Tally`, one per module) stay on
the device; :mod:`ampguard.underflow.counts` says what they mean and brings
them to the host. Healthy steps run none of this: the hooks exist only between
:meth:`Sampler.arm` and :meth:`Sampler.finish`.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import ampguard.containment as containment
import ampguard.underflow.nodes as node_kinds
from ampguard.module_hooks import GlobalModuleHooks
from ampguard.torch_privates import in_functorch_transform, is_compiling
from ampguard.underflow.counts import Tally, on, passed_on
from ampguard.underflow.flushes import Flushes


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


# Where a module call's walk ends: at the nodes made before the call began. autograd numbers each node it makes
# from a counter of the thread (``Node._sequence_nr``); read as the call begins, it tells the nodes the call made
# from its caller's and from those of the calls before it, whichever way they came in (by position, by keyword,
# through an attribute). Without it (a torch that renamed it) only positional inputs end a walk, as before: keyword
# inputs then cost a walk down through every layer below (quadratic in depth) and count the caller's nodes in the
# first child that reaches them.
_next_sequence_nr: Callable[[], int] | None = getattr(torch._C._autograd, "_get_sequence_nr", None)

# One number per module call entered or left while a sample is armed, on any thread: a call during which another
# thread entered or left one (a DataParallel-like wrapper running replicas in threads) may reach nodes that another
# thread's counter numbered, so its walk ends at its positional inputs only.
_TICKETS = itertools.count()


class _Call:
    """A module call in progress on this thread, where its walk will end, and its children's walks so far."""

    __slots__ = ("inputs", "jumps", "own", "start", "ticket")

    def __init__(self, inputs: set[Any], start: int | None, ticket: int, own: int) -> None:
        self.inputs = inputs  # the nodes of its positional tensor inputs
        self.start = start  # the sequence number of the first node it could make (None: unknown)
        self.ticket = ticket  # its number from _TICKETS
        self.own = own  # the tickets this thread had taken then
        # A finished child's output node -> the nodes where the child's walk ended: this call's walk, reaching
        # the output, goes on from there instead of walking the child's nodes again (they are hooked already).
        self.jumps: dict[Any, list[Any]] = {}


# The node whose pre-hook runs (torch 2.3 to 2.14; without it nothing is passed down the graph, and every exact-zero
# gradient is judged by the step alone: ampguard.underflow.counts).
_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)

# The backward pass (graph task) this thread runs, -1 outside one (torch 2.3 to 2.14; without it every backward
# pass is one, -1: a sample counts every backward pass through the nodes it hooked, as before).
_current_task: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)


class Sampler:
    """Owns one sampled step: its hooks while armed, its tallies until read.

    An armed sampler that is never finished (its scaler dropped, training over
    with the sample due) disarms itself after :data:`MAX_CALLS` outermost module
    calls without a backward pass through the sample between them: it never
    keeps walking graphs. A validation that long drops the sample (the listener
    tries again at the next scheduled step).

    Armed for a scaler (``own_losses``), it counts only the backward passes of
    the losses that scaler scaled (:meth:`own_loss`): another model's backward
    pass, scaled by another scaler (a GAN's other half), reaches the nodes its
    walks hooked but is not counted.
    """

    MAX_CALLS = 1024  # a forward pass that is no module call itself may make a few hundred (a loop over layers)

    def __init__(self) -> None:
        self.tallies: dict[int, Tally] = {}  # id(module) -> its tally, for this sample
        self._modules: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
        self._mark = f"ampguard.underflow.{id(self)}"  # node.metadata key: the session that hooked the node
        self._flushes = Flushes(f"{self._mark}.fed")  # whether the gradients counted were flushed, passed down
        # The node hooks' handles, removed when the sample ends: a node kept across samples (a parameter's
        # accumulator, which DistributedDataParallel keeps) carries no hook between them.
        self._node_hooks: list[Any] = []
        self._calls = 0  # outermost module calls since armed, or since the sample's last backward
        # Per thread, per module call in progress: the nodes of its inputs (where its walk ends); its length is
        # the call depth (another thread's module calls are not this thread's children).
        self._calls_in_progress = threading.local()
        self._names: dict[int, str] = {}  # id(module) -> qualified name in the outermost module called
        self._session = 0  # node hooks of an earlier sample (a retained graph) do nothing
        self._own_losses = False  # count only the backward passes (graph tasks) in _tasks
        self._tasks: set[int] = set()  # those of the losses given to own_loss, this sample
        self._walked_now = False
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
        self.tallies, self._names, self._calls_in_progress = {}, {}, threading.local()
        self._own_losses, self._tasks = own_losses, set()
        self._walked_now = False  # a module call's graph was walked, this sample
        self._calls = 0
        self._hooks.arm()

    def own_loss(self, scaled: Any) -> None:
        """``scaled`` (a tensor or a container of them) is a loss of this sample's scaler: the backward passes
        started from it are counted. Its node, the first its backward pass runs, records that pass (graph task)
        when reached; backward passes nested in it (a reentrant checkpoint's) are counted through the walks made
        inside it (:meth:`_count`). A loss of a model whose module calls the sample did not see
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
                    if not self._walked_now:
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
        self.tallies = {}
        containment.report(f"underflow sample ({where})", error)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if is_compiling():
            return
        if in_functorch_transform():  # (the forward hook returns here too: the call depth stays as it is)
            node_kinds.step_aside_transformed()
            return
        try:
            self._enter(module, args)
        except Exception as error:
            self._fail("module forward pre-hook", error)

    def _inputs(self) -> list[_Call]:
        """This thread's module calls in progress (where their walks end)."""
        inputs: list[_Call] | None = getattr(self._calls_in_progress, "inputs", None)
        if inputs is None:
            inputs = self._calls_in_progress.inputs = []
        return inputs

    # The nodes visited by this sampler's walks, all samples together (tests count them: a cost linear in depth).
    walked = 0

    def _ticket(self) -> tuple[int, int]:
        """A number from :data:`_TICKETS`, and the count of those this thread has taken."""
        local = self._calls_in_progress
        own: int = getattr(local, "tickets", 0) + 1
        local.tickets = own
        return next(_TICKETS), own

    def _enter(self, module: nn.Module, args: Any) -> None:
        in_progress = self._inputs()
        if not in_progress:
            self._calls += 1
            if self._calls > self.MAX_CALLS:  # nobody finishes this sample
                self.disarm()
                self.tallies = {}
                return
        if not in_progress and id(module) not in self._names:
            for name, child in module.named_modules():
                self._names.setdefault(id(child), name or type(module).__name__)
        ticket, own = self._ticket()
        start = _next_sequence_nr() if _next_sequence_nr is not None else None
        in_progress.append(_Call({t.grad_fn for t in _tensors(args) if t.grad_fn is not None}, start, ticket, own))

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        # is_compiling() first: dynamo must not trace ampguard's state (a RemovableHandle: fullgraph=True raised)
        if is_compiling() or not self.armed or in_functorch_transform():
            return
        try:
            self._leave(module, output)
        except Exception as error:
            self._fail("module forward hook", error)

    def _leave(self, module: nn.Module, output: Any) -> None:
        in_progress = self._inputs()
        call = in_progress.pop() if in_progress else None
        ticket, own = self._ticket()
        if not torch.is_grad_enabled():
            return
        nodes = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        if not nodes:
            return
        if call is None:
            self._hook_graph(module, nodes, set(), None, {})
            return
        alone = ticket - call.ticket == own - call.own  # no other thread entered or left a module call meanwhile
        start = call.start if alone else None
        ended = self._hook_graph(module, list(nodes), call.inputs, start, call.jumps)
        outputs = set(nodes)
        if in_progress and len(outputs) == 1:  # (of several outputs, one may reach less of the walk than another)
            [node] = outputs
            if node not in call.inputs and (start is None or node._sequence_nr() >= start):  # (walked from)
                in_progress[-1].jumps[node] = ended

    def _hook_graph(
        self, module: nn.Module, stack: list[Any], inputs: set[Any], start: int | None, jumps: dict[Any, list[Any]]
    ) -> list[Any]:
        """Hook the nodes this module call made that no module inside it hooked: from its outputs down to the
        nodes made before it began (``start``: the first sequence number it could have given; its inputs, by
        position or keyword, are its caller's) and its positional inputs' nodes; returns those where it ended.
        The walk hooks the nodes it made itself between its children (an attention's matmuls between its
        projections): reaching a child's output, it goes on from where the child's walk ended (``jumps``), so a
        node is walked once, by the innermost call that made it, and a sampled step's walks cost what its graph
        does (linear in depth)."""
        slot = id(module)
        session, mark, hooks = self._session, self._mark, self._node_hooks
        self._walked_now = True
        within = _current_task()  # (a forward run inside a backward pass: a reentrant checkpoint's recomputation)

        def count(gradients: tuple[torch.Tensor | None, ...]) -> None:  # (one per walk, for all its nodes)
            self._count(slot, session, within, gradients)

        seen: set[Any] = set()
        ended: list[Any] = []
        visited = 0
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            visited += 1
            if node in inputs or (start is not None and node._sequence_nr() < start):  # (an accumulator's: the
                ended.append(node)  # largest number, walked)
                continue
            child_ended = jumps.get(node)
            if child_ended is not None:
                stack.extend(child_ended)
                continue
            if type(node).__name__ in node_kinds.COMPILED_NODE_KINDS:  # (its incoming gradient: its output's only)
                node_kinds.step_aside_compiled(module, self._names.get(slot) or type(module).__name__)
            elif node_kinds.counted(node):
                metadata = node.metadata
                if metadata.get(mark) != session:
                    metadata[mark] = session
                    hooks.append(node.register_prehook(count))  # (the handle holds no node)
            stack.extend([next_node for next_node, _ in node.next_functions])
        self._modules[slot] = module
        self.walked += visited
        return ended

    def _count(self, slot: int, session: int, within: int, gradients: tuple[torch.Tensor | None, ...]) -> None:
        """Count the node's float16 gradients, fed whether a gradient they were computed from was flushed, and
        pass on to the nodes below whether they were (:func:`~ampguard.underflow.counts.passed_on`: an all-zero
        gradient computed from a flushed one is lost, another is a true zero). Once a float16 gradient was
        counted, the node's other floating gradients (float32 under autocast: a float32 op's input, the residual
        stream the float16 branches are cast from) pass it on too. Armed for a scaler, only in its losses'
        backward passes, or in one nested in them (``within``: the backward pass the walk ran in, -1: none)."""
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
            fed = self._flushes.fed(node, session)
            passes: torch.Tensor | None = None
            for gradient in gradients:
                passed: torch.Tensor | None = None
                if node_kinds.countable(gradient):
                    tally = self.tallies.get(slot)
                    if tally is None:
                        module = self._modules.get(slot)
                        name = self._names.get(slot) or (type(module).__name__ if module is not None else "?")
                        tally = self.tallies[slot] = Tally(name, gradient.device)
                    tally.fed = fed
                    passed = tally.add(gradient)
                elif self.tallies and node_kinds.dense(gradient):
                    passed = passed_on(gradient.detach().abs().amax(), fed)
                if passed is not None:
                    passes = passed if passes is None else passes | on(passed, passes.device)
            if passes is not None and node is not None:
                self._flushes.pass_on(node, session, passes)
        except Exception as error:
            self._fail("backward node hook", error)

    def finish(self) -> list[Tally]:
        """End the sample: no more counting; the tallies, to :func:`read`."""
        self.disarm()
        self._session += 1
        self._remove_node_hooks()
        self._flushes.clear()
        tallies, self.tallies = list(self.tallies.values()), {}
        return tallies
