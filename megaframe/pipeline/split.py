"""The zero-bubble schedules' split backward: B (the input gradient) now, W (the weight gradients) later.

Design: the graph split of torch.distributed.pipelining (`_backward.stage_backward_input` /
`stage_backward_weight`), not Megatron's zero-bubble fork of every weighted autograd Function. B runs
the engine from the chunk's root to its input only (`inputs=(x,)`, graph kept): the engine executes just
the nodes on the path to x, and for nodes like MmBackward only the outputs that path needs. Before it,
B finds each parameter's *intermediates*: the first nodes on the way from the parameter towards the root
that B executes (an addmm's AddmmBackward, a norm's backward, the fused head+CE); pre-hooks on them keep
the output grads B computes there. W then runs the engine from those saved grads at those nodes to the
parameters only: the nodes recompute nothing of B's (the engine asks each node only for the outputs the
parameters need; our own Functions ask `wanted`), and since W is an ordinary `torch.autograd.backward`
with `inputs=params`, the grads land through AccumulateGrad exactly as an unsplit backward puts them:
into p.grad / the ZeRO grad buffer, firing the post-accumulate hooks (ZeRO's bucket reduce-scatters
then launch at W, where the executor marks the last W of a chunk).

Why this and not (a), a split inside each weighted Function: (a) needs a hand-written backward for every
op that touches a weight (linears in four variants, norms, embedding, learned positions, grouped and
looped experts, router, fused CE) and has to be kept in step with each of them; the graph split covers
every layer, present and future, with exact grads by construction (the same engine, the same node
formulas), and keeps full and selective recompute working (checkpointed regions re-run inside B; W
re-runs the checkpoint's forward once more when it reads a saved input, torch.utils.checkpoint's rule
for a second graph task: extra forward FLOPs under recompute, never wrong grads).
Memory: B keeps the graph (W runs in it), but not what it holds: under `saving()` (the executor's
forward of a split chunk) every tensor autograd saves goes into a box; during B each box is matched to
the node that reads it, and after B the boxes of every node W will not run (attention, activations,
softmax: all but the weighted ops' inputs) are emptied. So from B to W a micro-batch holds only the
weighted ops' saved inputs (and the output grads at those ops), as Megatron's per-op split does. A
group where one parameter's node feeds another's (a weight used twice on one path) keeps everything:
W runs the path between them. torch.compile
is refused with the zero-bubble kinds (config/checks.py): a compiled block's backward is one node that
computes every grad at once, which W would run a second time.

The first stage has no input gradient to compute (token ids): its B does nothing and its W runs the
whole backward, so the weights' accumulation still happens at W.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
from torch.autograd import Variable
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def wanted(t: torch.Tensor) -> bool:
    """Inside a custom Function's backward: whether the running backward wants the gradient of input `t`
    (a split backward asks a weighted Function twice, once for the input grad (B), once for the weight
    grad (W); computing or scaling the other one would be wasted or, in place, wrong)."""
    if not t.requires_grad:
        return False
    node = get_gradient_edge(t).node
    return node is None or torch._C._will_engine_execute_node(node)


class _Box:
    """One saved tensor, held for autograd by `saving()`: emptied once B knows no W reads it."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t


_running: list = []  # during B: [the node the engine is running]; its unpacks are matched to it
_unpacked: list | None = None  # during B: (box, node) of every unpack


def _unpack(box: _Box) -> torch.Tensor:
    if _unpacked is not None:
        _unpacked.append((box, _running[0] if _running else None))
    assert box.t is not None, "split backward: W read a saved tensor that B released"
    return box.t


def saving():
    """Around the forward of a chunk whose backward will
    be split: saved tensors boxed (see the module doc)."""
    return torch.autograd.graph.saved_tensors_hooks(_Box, _unpack)


@dataclass
class PendingW:
    """What W needs of one (micro-batch, chunk): the saved output grads at each parameter group's nodes."""

    groups: list = field(default_factory=list)  # [(params, intermediates, {node: grads})]
    rest: tuple | None = None  # (root, grad, params): whole backward for params not reached through x
    released: int = 0  # bytes of saved tensors B released (W does not read them)


def _node(t: torch.Tensor) -> Node | None:
    return get_gradient_edge(t).node if t.requires_grad else None


def _reverse_edges(root: Node) -> dict[Node, list[Node]]:
    """consumer lists: for each node reachable from the root, the nodes whose next_functions name it."""
    rev: dict[Node, list[Node]] = collections.defaultdict(list)
    q, seen = collections.deque([root]), {root}
    while q:
        node = q.popleft()
        for nxt, _ in node.next_functions:
            if nxt is not None:
                rev[nxt].append(node)
                if nxt not in seen:
                    seen.add(nxt)
                    q.append(nxt)
    return rev


def _closure(starts, rev, stop: set) -> tuple[set, set]:
    """Nodes reachable from `starts` walking towards the root; walks stop at `stop` nodes (returned apart)."""
    inside, hit = set(starts), set()
    q = collections.deque(starts)
    while q:
        for up in rev.get(q.popleft(), ()):
            if up in stop:
                hit.add(up)
            elif up not in inside:
                inside.add(up)
                q.append(up)
    return inside, hit


def _groups(rev: dict, x_node: Node, params: list[torch.Tensor]) -> tuple[list, list, set]:
    """Parameter groups (params, intermediates) that share intermediates, the params reached from the root
    without passing through a node that depends on x, and every node W runs (intermediates, and the nodes
    between them and the parameters)."""
    on_x, _ = _closure([x_node], rev, set())
    by_node: dict[Node, dict] = {}
    rest, w_nodes = [], set()
    for p in params:
        acc = _node(p)
        if acc not in rev:
            continue  # not used by this chunk's graph (another chunk's, or unused)
        between, hit = _closure([acc], rev, on_x)
        w_nodes |= between | hit
        if not hit:
            rest.append(p)
            continue
        group = {"params": [p], "nodes": set(hit)}
        for n in hit:  # merge every group that shares one of these nodes
            other = by_node.get(n)
            if other is not None and other is not group:
                group["params"] += [q for q in other["params"] if all(q is not r for r in group["params"])]
                group["nodes"] |= other["nodes"]
        for n in group["nodes"]:
            by_node[n] = group
    unique = {id(g): g for g in by_node.values()}.values()
    return [(g["params"], list(g["nodes"])) for g in unique], rest, w_nodes


def backward_input(
    root: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None, params: list[torch.Tensor]
) -> tuple[torch.Tensor | None, PendingW]:
    """B: the gradient of the chunk input `x` (None on the first stage: then B computes nothing and W
    runs the whole backward), and what W needs."""
    grad = torch.ones_like(root) if grad is None else grad
    if x is not None and root is x:
        # a chunk of 0 layers hands its input on unchanged: its input gradient is the output's, and no W
        return grad, PendingW()
    if x is None or root.grad_fn is None:
        return None, PendingW(rest=(root, grad, None))
    rev = _reverse_edges(root.grad_fn)
    groups, rest, w_nodes = _groups(rev, _node(x), params)
    pending = PendingW(rest=(root, grad, rest) if rest else None)
    handles = []
    for params_g, nodes in groups:
        saved: dict = {}
        pending.groups.append((params_g, nodes, saved))
        for n in nodes:
            handles.append(n.register_prehook(lambda g, n=n, saved=saved: saved.__setitem__(n, g) and None))
    # the node running now, for _unpack to match boxes to their readers
    handles += [
        n.register_prehook(lambda g, n=n: _running.__setitem__(slice(None), [n]))
        for n in (root.grad_fn, *rev)
        if type(n).__name__ != "AccumulateGrad"
    ]
    global _unpacked
    _unpacked = []
    try:
        # the root's storage may be released already (executor): run the engine directly, no shape check
        (gx,) = Variable._execution_engine.run_backward((root,), (grad,), True, False, (x,), True, False)
        unpacked = _unpacked
    finally:
        _unpacked, _running[:] = None, []
        for h in handles:
            h.remove()
    if all(len(nodes) == 1 for _, nodes in groups):  # else W runs paths between a group's nodes: keep all
        pending.released = _release(unpacked, w_nodes)
    return gx, pending


def _release(unpacked: list, w_nodes: set) -> int:
    """Empty the boxes that only nodes W does not run read; returns the bytes freed (storage shared with a
    kept tensor, e.g. a weight or another box's view, is not freed by this, only unreferenced)."""
    keep = {id(box) for box, node in unpacked if node is None or node in w_nodes}
    freed = 0
    for box, _ in unpacked:
        if id(box) not in keep and box.t is not None:
            freed += 0 if box.t.is_leaf else box.t.nbytes  # a leaf (a weight) stays alive anyway
            box.t = None
    return freed


def _replace_with(grads):
    return lambda _incoming: grads


def backward_weight(pending: PendingW) -> None:
    """W: every parameter grad of the micro-batch's chunk, accumulated through AccumulateGrad (hooks fire)."""
    for params, nodes, saved in pending.groups:
        edges, grads = [], []
        for n in nodes:
            for i, g in enumerate(saved.get(n, ())):
                if g is not None:
                    edges.append(GradientEdge(n, i))
                    grads.append(g)
        # one node of the group may feed another (a param used twice on one path): each node then runs
        # with exactly the grad B saw there, not that plus what flows into it from the first
        hs = [n.register_prehook(_replace_with(saved.get(n))) for n in nodes] if len(nodes) > 1 else []
        try:
            if edges:
                torch.autograd.backward(edges, grads, inputs=params)
        finally:
            for h in hs:
                h.remove()
    if pending.rest is not None:
        root, grad, params = pending.rest
        # the first stage (params=None): the whole backward; else only the params B could not reach
        Variable._execution_engine.run_backward(
            (root,), (grad,), False, False, tuple(params or ()), True, True
        )
