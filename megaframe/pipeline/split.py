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
The price, stated: the chunk's autograd graph (its saved activations) stays alive from B to W, not just
the (input, output grad) pairs W reads: a micro-batch's activations are freed at W, so a zero-bubble
rank holds up to activation_bound + max_pending_w micro-batches' activations (schedule.py). torch.compile
is refused with the zero-bubble kinds (config_checks): a compiled block's backward is one node that
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


@dataclass
class PendingW:
    """What W needs of one (micro-batch, chunk): the saved output grads at each parameter group's nodes."""

    groups: list = field(default_factory=list)  # [(params, intermediates, {node: grads})]
    rest: tuple | None = None  # (root, grad, params): whole backward for params not reached through x


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


def _groups(root: Node, x_node: Node, params: list[torch.Tensor]) -> tuple[list, list]:
    """Parameter groups (params, intermediates) that share intermediates, and the params reached from
    the root without passing through a node that depends on x."""
    rev = _reverse_edges(root)
    on_x, _ = _closure([x_node], rev, set())
    by_node: dict[Node, dict] = {}
    rest = []
    for p in params:
        acc = _node(p)
        if acc not in rev:
            continue  # not used by this chunk's graph (another chunk's, or unused)
        _, hit = _closure([acc], rev, on_x)
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
    return [(g["params"], list(g["nodes"])) for g in unique], rest


def backward_input(root: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None,
                   params: list[torch.Tensor]) -> tuple[torch.Tensor | None, PendingW]:
    """B: the gradient of the chunk input `x` (None on the first stage: then B computes nothing and W
    runs the whole backward), and what W needs."""
    grad = torch.ones_like(root) if grad is None else grad
    if x is None or root.grad_fn is None:
        return None, PendingW(rest=(root, grad, None))
    groups, rest = _groups(root.grad_fn, _node(x), params)
    pending = PendingW(rest=(root, grad, rest) if rest else None)
    handles = []
    for params_g, nodes in groups:
        saved: dict = {}
        pending.groups.append((params_g, nodes, saved))
        for n in nodes:
            handles.append(n.register_prehook(lambda g, n=n, saved=saved: saved.__setitem__(n, g) and None))
    try:
        # the root's storage may be released already (executor): run the engine directly, no shape check
        (gx,) = Variable._execution_engine.run_backward((root,), (grad,), True, False, (x,), True, False)
    finally:
        for h in handles:
            h.remove()
    return gx, pending


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
        Variable._execution_engine.run_backward((root,), (grad,), False, False, tuple(params or ()), True, True)
