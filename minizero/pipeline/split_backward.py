"""The backward pass split in two: B (input gradient) now, W (weight gradients) later.

Zero-bubble pipelining (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §2) observes that
a stage's backward is two computations with different deadlines. For y = x·Wᵀ:
    B:  dx = dy·W       the previous stage is waiting for it: on the critical path
    W:  dW = dyᵀ·x      only the optimizer needs it, at the end of the step
so a schedule can run B at once and postpone W into the time it would otherwise sit idle.

autograd does not have "B" and "W" as separate passes, but its graph has what is needed.
Every weight gradient is computed by a node where the weight's path meets the input's path
(a Linear's AddmmBackward, a LayerNorm's backward, the add of a bias): call it the weight's
*meeting node*. Then:
  B = autograd.grad(output, input): runs every node between output and input. A meeting node
      runs too, but computes only its input-side result (autograd asks each node only for the
      outputs on a path to the requested inputs). A hook on each meeting node keeps the
      gradient that arrived at it.
  W = for each group of weights sharing meeting nodes: autograd.backward from those nodes
      (GradientEdge) with the kept gradients, inputs=the weights: runs only the weight side.
Nothing is computed twice. The price is memory: the nodes W restarts from (and what they saved),
and the gradients kept for them, live from B until W; the rest of the graph is let go after B.
(torch.distributed.pipelining's stage_backward_input/weight work the same way.)
A stage whose input needs no gradient (the first: token ids) has no B to do: W runs it all.
"""
from __future__ import annotations

from collections import defaultdict, deque

import torch
from torch.autograd.graph import GradientEdge


def _grad_node(t: torch.Tensor):
    """The autograd node that receives t's gradient: grad_fn, or a leaf's AccumulateGrad."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]  # the leaf's (cached) AccumulateGrad


def _consumers(root) -> dict:
    """node -> the nodes that feed gradient into it (the graph's edges, turned around)."""
    users, seen, todo = defaultdict(list), {root}, deque([root])
    while todo:
        node = todo.popleft()
        for nxt, _ in node.next_functions:
            if nxt is not None:
                users[nxt].append(node)
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
    return users


def _reach(starts, users, stop=frozenset()) -> tuple[set, set]:
    """Nodes reachable from `starts` towards the output; stops at (and reports) nodes in `stop`."""
    seen, hit, todo = set(starts), set(), deque(starts)
    while todo:
        for user in users[todo.popleft()]:
            if user in stop:
                hit.add(user)
            elif user not in seen:
                seen.add(user)
                todo.append(user)
    return seen, hit


class SplitBackward:
    """One micro-batch's backward through one chunk, as B() then W()."""

    def __init__(self, output: torch.Tensor, input: torch.Tensor | None, weights):
        self.output = output                # the chunk's output (or the loss on the last stage)
        self.input = input if input is not None and input.requires_grad else None
        # no input gradient (the first stage): W is the whole backward
        self.whole = self.input is None
        self.weights = [w for w in weights if w.requires_grad]
        self.kept = {}                      # meeting node -> the gradients that arrived at it in B
        self.groups = []                    # [(weights, meeting nodes)] each W call handles
        self.orphans = []                   # weights whose path never meets the input's
        self.hooks = []
        if self.input is not None:
            self._find_meeting_nodes()

    def _find_meeting_nodes(self):
        users = _consumers(_grad_node(self.output))
        on_input_path, _ = _reach([_grad_node(self.input)], users)
        owner = {}  # meeting node -> group index: weights that share a node are one W call
        groups = []
        for w in self.weights:
            _, meets = _reach([_grad_node(w)], users, stop=on_input_path)
            if not meets:
                self.orphans.append(w)
                continue
            found = {owner[n] for n in meets if n in owner}
            merged = ([w], set(meets))
            for g in sorted(found, reverse=True):
                merged[0].extend(groups[g][0])
                merged[1].update(groups[g][1])
                groups[g] = None
            groups.append(merged)
            for n in merged[1]:
                owner[n] = len(groups) - 1
        self.groups = [g for g in groups if g is not None]
        for _, nodes in self.groups:
            for node in nodes:
                self.hooks.append(node.register_prehook(self._keep(node)))

    def _keep(self, node):
        def hook(grad_outputs):
            self.kept[node] = grad_outputs
        return hook

    def input_gradient(self, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """B: the gradient of the chunk's input (None on the first stage: nothing to compute)."""
        self.grad_output = grad_output
        if self.input is None:
            return None
        try:
            (grad_input,) = torch.autograd.grad(self.output, self.input, grad_output,
                                                retain_graph=True)
        finally:
            for h in self.hooks:
                h.remove()
        if not self.orphans:  # W restarts at the meeting nodes: let the rest of the graph go now
            self.output = self.input = self.grad_output = None
        return grad_input

    def weight_gradient(self):
        """W: accumulate the weights' gradients into .grad (hooks of DDP/ZeRO fire as usual)."""
        if self.whole:  # the first stage: the whole backward is weight gradient
            torch.autograd.backward(self.output, self.grad_output, inputs=self.weights)
            return
        if self.orphans:
            torch.autograd.backward(self.output, self.grad_output, retain_graph=True,
                                    inputs=self.orphans)
        for weights, nodes in self.groups:
            edges, grads = [], []
            for node in nodes:
                for i, g in enumerate(self.kept.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            if edges:
                restore = []
                if len(nodes) > 1:  # a weight used at two meeting nodes: a path from one may run
                    for node in nodes:  # through the other; give each exactly what B left there
                        restore.append(node.register_prehook(lambda _,
                                                             kept=self.kept.get(node): kept))
                try:
                    torch.autograd.backward(edges, grads, retain_graph=True, inputs=weights)
                finally:
                    for h in restore:
                        h.remove()
        self.kept, self.groups = {}, []  # the meeting nodes and what they saved can go now

    def kept_bytes(self) -> int:
        """Bytes of the gradients B kept for W (storages once): not saved tensors, yet held."""
        storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                    for grads in self.kept.values() for g in grads if g is not None}
        return sum(storages.values())

