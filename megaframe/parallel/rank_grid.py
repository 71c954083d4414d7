"""The rank arithmetic of a layout: the one place that knows the axis order and group membership.

    position = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
    dpcp_rank = cp_rank + cp * dp_rank = shard_rank + shard * rep_rank

Experts are placed as Megatron folds them ("MoE parallel folding"): the tp·cp·dp ranks of one pipeline
stage, in position order, are cut again for the expert layers alone into etp (experts' own tensor
parallelism, innermost), ep and edp (the experts' data parallelism, outermost):

    stage_rank = tp_rank + tp * dpcp_rank = etp_rank + etp * (ep_rank + ep * edp_rank)

so ep takes its ranks from tp first (the nearest ranks: the token all-to-all runs twice per layer and
direction), then cp, then dp, and edp = tp·cp·dp / (ep·etp) follows. Every rank routes its own tokens
(MoE under tp needs sp), so the expert grads are partial over all of tp·cp·dp and summed over edp.
With tp = etp = 1 this is the cut of cp·dp into ep blocks of before.

Dispatch by node (parallel.ep_dispatch=node, `node` positions a node): each ep group is cut again into
its members on one node (`ep_node`, consecutive ep ranks) and `ep_rail`, the members at the same place of
their node (one per node, in node order): a token crosses nodes over ep_rail once per node it needs, then
reaches its experts over ep_node (model/moe/node_dispatch.py).

HSDP (shard = s < cp·dp) runs r = cp·dp/s replicas of the optimizer (Megatron's distributed optimizer
instances); the experts keep the same replica count: edp is cut into `edp_shard` blocks of edp/r
consecutive edp ranks (ZeRO shards expert state over them) and `edp_rep`, their r replicas.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class RankGrid:
    """build_mesh creates a process group per group listed here; virtual_mesh (planning) reads the same
    membership without groups. Positions are 0..world-1; build_mesh maps them to process ranks."""

    tp: int
    dp: int
    pp: int
    ep: int = 1
    shard: int = 0
    """HSDP shard group size (dp_shard), out of the cp·dp ranks; 0 means cp·dp (no replication across
    shard groups)."""
    cp: int = 1
    """Context-parallel size (between tp and dp in the rank order)."""
    etp: int = 1
    """Experts' own tensor-parallel size (innermost in the experts' cut of the stage)."""
    node: int = 0
    """Positions per node when the ep all-to-all goes by node (ep_node / ep_rail axes); 0: not cut."""

    AXES = ("tp", "dp", "pp", "pp_ends", "ep", "edp", "dp_shard", "dp_rep", "cp", "dpcp")
    EXPERT_AXES = ("etp", "edp_shard", "edp_rep")
    NODE_AXES = ("ep_node", "ep_rail")
    STATS = {
        "pp_ends": "pp",
        "edp": "dp",
        "dp_shard": "dp",
        "dp_rep": "dp",
        "dpcp": "dp",
        "edp_shard": "dp",
        "edp_rep": "dp",
        "ep_node": "ep",
        "ep_rail": "ep",
    }
    """The byte counter of an axis, where it is not its own name (an Axis's `name`)."""

    def __post_init__(self):
        # Uneven blocks would give ranks different expert counts and edp groups of different sizes.
        assert self.stage % (self.ep * self.etp) == 0, (
            f"ep·etp={self.ep * self.etp} does not divide tp·cp·dp={self.stage}"
        )
        if not self.shard:
            object.__setattr__(self, "shard", self.cp * self.dp)
        assert self.cp * self.dp % self.shard == 0, (
            f"shard group size {self.shard} does not divide cp·dp={self.cp * self.dp}"
        )
        assert self.edp % self.replicas == 0, f"{self.replicas} HSDP replicas do not divide edp={self.edp}"
        if self.by_node:
            # the by-node dispatch gathers no rows over etp: it would run the experts' slices alone
            if self.etp > 1:
                raise ValueError(f"parallel.ep_dispatch=node needs parallel.etp=1 (got {self.etp})")
            self._node_blocks()  # raises where an ep group does not split into equal node blocks

    @property
    def stage(self) -> int:
        """Ranks of one pipeline stage: tp·cp·dp, the ranks the experts are folded over."""
        return self.tp * self.cp * self.dp

    @property
    def edp(self) -> int:
        """The experts' data-parallel size: tp·cp·dp / (ep·etp)."""
        return self.stage // (self.ep * self.etp)

    @property
    def replicas(self) -> int:
        """HSDP's optimizer replicas (cp·dp / shard); 1 without HSDP."""
        return self.cp * self.dp // self.shard

    @property
    def hybrid(self) -> bool:
        """Whether cp·dp is cut into HSDP shard groups (then dp_shard and dp_rep get their own groups)."""
        return self.shard < self.cp * self.dp

    @property
    def folded(self) -> bool:
        """Whether the experts have axes of their own (ep or etp > 1): else ep is of size 1 and
        edp is dpcp, the Mesh defaults."""
        return self.ep * self.etp > 1

    @property
    def by_node(self) -> bool:
        """Whether the ep groups are cut by node (ep_node, ep_rail axes)."""
        return self.node > 0 and self.ep > 1

    def _node_blocks(self) -> int:
        """Ep ranks per node in every ep group (the ep_node size), the same for all of them: an ep group's
        positions increase with its ep rank, so each node's members are consecutive ep ranks."""
        sizes = set()
        for g in self._expert_groups("ep"):
            per_node = Counter(q // self.node for q in g)
            sizes |= set(per_node.values())
        if len(sizes) != 1:
            raise ValueError(
                "parallel.ep_dispatch=node needs every ep group to hold the same ranks on each of its "
                f"nodes; at {self.node} ranks a node they hold {sorted(sizes)}"
            )
        return sizes.pop()

    @property
    def world(self) -> int:
        return self.stage * self.pp

    def creation_order(self) -> tuple[str, ...]:
        """The axes whose process groups build_mesh creates, in the order every process creates them."""
        # cp and dpcp before the expert axes: an ep or edp group may be a whole cp, dp or dpcp group,
        # and then reuses its communicator
        return (
            self.AXES[:4]
            + (("cp", "dpcp") if self.cp > 1 else ())
            + (("dp_shard", "dp_rep") if self.hybrid else ())
            + (
                (("ep", "edp", "etp") + (("edp_shard", "edp_rep") if self.hybrid else ()))
                if self.folded
                else ()
            )
            + (self.NODE_AXES if self.by_node else ())
        )

    def position(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))

    def _expert_groups(self, name: str) -> list[tuple[int, ...]]:
        """The folded expert groups, stage by stage: stage_rank = i + etp * (r + ep * e)."""
        etp, ep, edp = self.etp, self.ep, self.edp

        def at(p: int, i: int, r: int, e: int) -> int:
            return p * self.stage + i + etp * (r + ep * e)

        stages = range(self.pp)
        if name == "etp":
            return [
                tuple(at(p, i, r, e) for i in range(etp))
                for p in stages
                for e in range(edp)
                for r in range(ep)
            ]
        if name == "ep":
            return [
                tuple(at(p, i, r, e) for r in range(ep))
                for p in stages
                for e in range(edp)
                for i in range(etp)
            ]
        edp_groups = [
            tuple(at(p, i, r, e) for e in range(edp)) for p in stages for r in range(ep) for i in range(etp)
        ]
        if name == "edp":
            return edp_groups
        block = edp // self.replicas
        if name == "edp_shard":  # HSDP: blocks of edp/replicas consecutive edp ranks
            return [g[j : j + block] for g in edp_groups for j in range(0, edp, block)]
        if name == "edp_rep":  # HSDP: the edp ranks at the same position of their block
            return [g[j::block] for g in edp_groups for j in range(block)]
        raise KeyError(name)

    def groups(self, name: str) -> list[tuple[int, ...]]:
        """Every group of axis `name`, in one fixed order (every process creates them in this order)."""
        if name in self.NODE_AXES:
            g, ep = self._node_blocks(), self._expert_groups("ep")
            if name == "ep_node":
                return [e[j : j + g] for e in ep for j in range(0, self.ep, g)]
            return [e[i::g] for e in ep for i in range(g)]
        if name in ("ep", "edp", "etp", "edp_shard", "edp_rep"):
            return self._expert_groups(name)
        at, tp, dp, pp, cp = self.position, self.tp, self.dp, self.pp, self.cp
        ctp = [(c, t) for c in range(cp) for t in range(tp)]
        # ordered by position: dpcp_rank = cp_rank + cp * dp_rank (with cp = 1 the dp groups, in their order)
        dpcp_groups = [
            tuple(at(p, d, t, c) for d in range(dp) for c in range(cp)) for p in range(pp) for t in range(tp)
        ]
        if name == "tp":
            return [
                tuple(at(p, d, t, c) for t in range(tp))
                for p in range(pp)
                for d in range(dp)
                for c in range(cp)
            ]
        if name == "dp":
            return [tuple(at(p, d, t, c) for d in range(dp)) for p in range(pp) for c, t in ctp]
        if name == "cp":
            return [
                tuple(at(p, d, t, c) for c in range(cp))
                for p in range(pp)
                for d in range(dp)
                for t in range(tp)
            ]
        if name == "dpcp":
            return dpcp_groups
        if name == "pp":
            return [tuple(at(p, d, t, c) for p in range(pp)) for d in range(dp) for c, t in ctp]
        if name == "pp_ends":  # first and last pipeline rank: the tied embedding's two copies
            return (
                [(at(0, d, t, c), at(pp - 1, d, t, c)) for d in range(dp) for c, t in ctp] if pp > 1 else []
            )
        if name == "dp_shard":  # HSDP: blocks of `shard` consecutive cp·dp ranks
            return [g[j : j + self.shard] for g in dpcp_groups for j in range(0, cp * dp, self.shard)]
        if name == "dp_rep":  # HSDP: the cp·dp ranks at the same position of their shard block
            return [g[e :: self.shard] for g in dpcp_groups for e in range(self.shard)]
        raise KeyError(name)

    def group_of(self, name: str, position: int) -> tuple[int, ...]:
        """The group of axis `name` holding `position`
        (just itself where it has none: off the pipeline ends)."""
        # A linear scan over every group: called once per axis at start-up, never in a step.
        return next((g for g in self.groups(name) if position in g), (position,))


def node_refusal(tp: int, dp: int, ep: int, cp: int = 1, etp: int = 1, node: int = 0) -> str | None:
    """Why dispatch by node cannot cut a stage's ep groups into nodes of `node` ranks, or None where it can
    (the grid's own check, read without building any group; every stage is cut alike)."""
    try:
        RankGrid(tp, dp, 1, ep=ep, cp=cp, etp=etp, node=node)
    except ValueError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class ExpertGroups:
    """Sizes and rank spans of the folded expert groups of a layout, for the planner (no processes)."""

    ep: int
    etp: int
    edp: int
    """The experts' data-parallel size: tp·cp·dp / (ep·etp)."""
    edp_shard: int
    """Ranks ZeRO shards expert state over: edp, cut by HSDP's replicas."""
    ep_span: int
    """Consecutive ranks an ep group spans (ep·etp: its members lie etp apart), what decides whether its
    all-to-all stays on a node."""
    edp_span: int
    """Consecutive ranks an edp group spans (the whole stage when edp > 1)."""


def folded_expert_groups(tp: int, cp: int, dp: int, ep: int, etp: int = 1, shard: int = 0) -> ExpertGroups:
    """The folded expert groups of a layout (ep·etp > 1; with ep = etp = 1 experts follow the dense cut:
    edp = cp·dp spanning tp·cp·dp). `shard`: optim.shard_group_size (0 = cp·dp)."""
    grid = RankGrid(tp=tp, dp=dp, pp=1, ep=ep, shard=shard, cp=cp, etp=etp)
    if not grid.folded:
        return ExpertGroups(1, 1, cp * dp, grid.shard, tp, grid.stage)
    edp = grid.edp
    return ExpertGroups(ep, etp, edp, edp // grid.replicas, ep * etp, grid.stage if edp > 1 else 1)
