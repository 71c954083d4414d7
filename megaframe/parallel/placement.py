"""Where one parameter (or state buffer) lives across the mesh: the one record every consumer reads.

A `Placement` is attached once, where the tensor is created (`layers.shard.sharded_param` as
`param.placement`, `module.state_placements` for buffers), and answers, per mesh axis:

    tp      split (a `Shard` along `dim`, fused blocks split separately) or replicated; a replicated
            tensor's grad may be partial over tp (sequence parallel: each rank saw its own block)
    ep      experts stacked along dim 0 are split over ep; with ep = 1 they are replicated over tp like the
            router, else (folded: rank_grid.py) their tp peers are ep or edp peers, not copies over tp
    dp      replicated; grads summed over cp·dp (dpcp: cp ranks hold other tokens of the same sequences),
            or over edp for experts (the tp·cp·dp ranks holding the same experts: ep folds the others).
            ZeRO shards the optimizer state over the same axis.
    pp      one stage holds it, except a tied embedding: a copy on each pipeline end whose grads are
            summed over `mesh.pp_ends`; the last stage's copy is the duplicate

Init (the shard of the full tensor), the gradient finalisation of every optimizer stage (which sums
over which axis, what counts in the norm), checkpoints (who writes, which slice) and the planner all
read this record; nothing re-derives it from names or ad-hoc attributes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from megaframe.parallel.mesh import Axis, Mesh


class ReplicaId(NamedTuple):
    """Which copy of its slice this rank holds, per kind of replication (Megatron's replica_id)."""

    tp: int
    """Index among the tp ranks holding the same slice (0 for tp-split tensors: no copies)."""
    pp: int
    """1 for the pipeline duplicate of a tied embedding, else 0."""
    dp: int
    """Rank on the data-parallel axis the tensor is replicated over (dp, or edp for experts)."""


@dataclass(frozen=True)
class Placement:
    """Layout of one tensor over the mesh; see the module docstring. `shard` is a layers.shard.Shard
    (global shape, split dim, fused parts, this rank's index and the split axis: "tp" or "ep")."""

    shard: object
    tp_partial_grad: bool = False
    """Replicated over tp but each tp rank's grad is a partial sum (sp): summed over tp before the norm."""
    pp_tied: bool = False
    """A copy lives on each pipeline end (tied embedding under pp > 1): grads summed over mesh.pp_ends."""
    pp_duplicate: bool = False
    """This rank's copy is the second one of a pp_tied tensor: not counted in the norm, not written."""
    role: str = "hidden"
    """hidden | embedding | head | router: what the tensor is to an update rule that treats the hidden
    matrices apart (Muon orthogonalises the hidden ones; norms and biases are 1-D)."""
    expert_rows: tuple[int, ...] = ()
    """Stacked expert weights: the logical matrices fused along each expert's rows ([gate | up]); () = one."""
    expert_folded: bool = False
    """Stacked expert weights on the folded expert grid (ep·etp > 1, parallel/rank_grid.py): not copies
    over tp (tp peers hold other experts or are edp peers), so no tp copy index and no tp-partial grad."""

    def __post_init__(self):
        assert self.pp_tied or not self.pp_duplicate, "a pipeline duplicate must be pp_tied"
        assert not (self.tp_split and self.tp_partial_grad), "a tp-split tensor's grad is not partial over tp"

    @property
    def split_axis(self) -> str | None:
        """The mesh axis this rank's slice is cut along ("tp", "ep"), or None for a whole tensor."""
        return None if self.shard.dim is None else self.shard.axis

    @property
    def tp_split(self) -> bool:
        """Whether tp ranks hold different slices (else the tensor is replicated over tp)."""
        return self.split_axis == "tp"

    @property
    def expert(self) -> bool:
        """Expert weights: split over ep, reduced (and ZeRO-sharded) over edp instead of dp."""
        return self.shard.axis == "ep"

    @property
    def replicated_over(self) -> tuple[str, ...]:
        """Mesh axes over which every rank holds the same values (after the grad reductions)."""
        axes = () if self.tp_split or self.expert_folded else ("tp",)
        return axes + (("edp",) if self.expert else ("dp",)) + (("pp_ends",) if self.pp_tied else ())

    @property
    def hidden_matrix(self) -> bool:
        """A hidden layer's 2-D weight (per expert for stacked experts): not embedding, head, router."""
        return len(self.shard.global_shape) >= 2 and self.role == "hidden"

    @property
    def matrix_rows(self) -> tuple[int, ...]:
        """The rows of each logical matrix fused along dim 0 of the global matrix (of each expert's, for
        experts): fused QKV's (q, k, v), gate/up's (gate, up); one block for an unfused weight."""
        if self.expert:
            return self.expert_rows or (self.shard.global_shape[1],)
        return self.shard.parts if self.shard.dim == 0 else (self.shard.global_shape[0],)

    def data_axis(self, mesh: Mesh) -> Axis:
        """The data-parallel axis its grads are summed over and its optimizer state is sharded over."""
        return mesh.edp if self.expert else mesh.dpcp  # dense params are replicated over cp too

    def replica_id(self, mesh: Mesh) -> ReplicaId:
        # A tp-split slice is unique on its tp rank (copy 0), whatever that rank's tp coordinate.
        tp_copy = mesh.tp.rank if "tp" in self.replicated_over else 0
        return ReplicaId(tp_copy, int(self.pp_duplicate), self.data_axis(mesh).rank)

    def counts_in_norm(self, mesh: Mesh) -> bool:
        """Whether this rank's copy adds to the global grad norm, so that each element counts once over
        tp and pp (dp copies are handled by the norm's reduction): tp-split slices on every tp rank,
        tp-replicated tensors on tp rank 0 only, and never a pipeline duplicate."""
        rid = self.replica_id(mesh)
        # No dp term: global_norm sums squares over dp only where ranks hold different elements (ZeRO's
        # ranges, experts), so equal dp copies are never counted twice.
        return rid.tp == 0 and rid.pp == 0

    def in_checkpoint(self, mesh: Mesh) -> bool:
        """Whether this rank's data-parallel group saves the slice (tp copy 0, not the pipeline duplicate).
        Every rank of that group takes part in gathering its optimizer state (a ZeRO collective)."""
        return self.counts_in_norm(mesh)

    def writes_checkpoint(self, mesh: Mesh) -> bool:
        """Whether this rank writes the slice: replica (0, 0, 0), so each element is written once."""
        return self.replica_id(mesh) == (0, 0, 0)
