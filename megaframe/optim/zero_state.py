"""ZeRO's layout and state (zero.py drives them): the flat buffers a rank's params live in, and the
update rule's state of this rank's owned range of each.

The state is "some state per owned element": one flat tensor per name the rule (optim/update_rule.py)
declares, never named here, holding only the elements of the params that name is kept for (a rule may keep
other state on hidden matrices than on the rest: Muon's momentum, AdamW's moments); a name every param
holds spans the rank's whole range (padding included), laid out as the master. The update is the rule's
step run on 1-D views of the owned range (segments); an elementwise rule's math is then exactly its math
on whole params, so zero=1 equals zero=0 elementwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

import torch
from torch import nn

from megaframe.config.schema import OptimConfig
from megaframe.optim.buffer import FlatBuffer, Segment, buffer_groups, give_storage, lazy_zeros, replicas_of
from megaframe.optim.muon_exchange import rank_ranges
from megaframe.optim.update_rule import STATE_DTYPES, RuleStep, UpdateRule
from megaframe.parallel.mesh import Mesh
from megaframe.parallel.placement import Placement


@dataclass
class FlatState:
    """This rank's flat optimizer state for one buffer (state_numel elements each)."""

    state: dict[str, torch.Tensor]
    """The rule's per-element state, by its names."""
    master: torch.Tensor | None
    """fp32 master weights for low-precision params; None when the param buffer is fp32 already."""
    at: dict[str, dict[int, int]]
    """Per name kept for some params only: id(segment) -> its first element in that name's tensor (a segment
    absent holds none of it); a name every param holds is at each segment's state_lo."""

    def views(self, seg) -> dict[str, torch.Tensor]:
        """The 1-D views of `seg`'s state, by the names its param holds."""
        out = {}
        for k, t in self.state.items():
            lo = self.at[k].get(id(seg)) if k in self.at else seg.state_lo
            if lo is not None:
                out[k] = t[lo : lo + seg.numel]
        return out

    def tensors(self) -> list[torch.Tensor]:
        """The rule's state and the master (when kept), made or not."""
        return [*self.state.values(), *([self.master] if self.master is not None else [])]


class OwnedState(NamedTuple):
    """What build_state hands the optimizer."""

    states: list[FlatState]
    """One per buffer, in buffer order."""
    segs_of: dict[nn.Parameter, list[tuple[Segment, torch.Tensor]]]
    """Each param's owned segments with the 1-D weights the rule updates for it (param buffer or master)."""
    update: RuleStep | None
    """None when this rank owns no element at all."""
    owned_grads: list[tuple[Placement, torch.Tensor]]
    """This rank's final grads: the owned segment of every parameter, viewed in the grad buffer (or shard)."""


def flat_buffers(params: list[nn.Parameter], cfg: OptimConfig, mesh: Mesh, make=None) -> list[FlatBuffer]:
    """The ZeRO buffers of a rank's params (one per buffer_groups entry: dtype and shard axis), made by
    `make(params, bucket_bytes, axis, late)` (the optimizer's stage-specific buffer; default ZeRO-1's).
    Also what checkpoint planning calls on a meta model to know every rank's segments."""
    # a tied embedding's grad is first summed over the pipeline ends (finalize): reduce it late
    late = {id(p) for p in params if p.placement.pp_tied}
    bucket_bytes = int(cfg.bucket_size_mb * 2**20)
    make = make or (lambda ps, b, axis, lt: FlatBuffer(ps, b, axis.rank, axis.size, lt))
    buffers = []
    for axis, ps in buffer_groups(params, mesh):
        buf = make(ps, bucket_bytes, axis, late)
        buf.axis = axis
        buf.rep = replicas_of(axis, mesh)
        buffers.append(buf)
    return buffers


def build_state(
    buffers: list[FlatBuffer],
    rule: UpdateRule,
    cfg: OptimConfig,
    device: torch.device,
    always_master: bool,
    source=None,
    mesh=None,
) -> OwnedState:
    """The rule's flat state (and master) per buffer, without storage until make_state; the rule's step over
    1-D segment views of them. `always_master`:
    an fp32 master for fp32 params too (zero=3, whose param buffer is not kept whole). A buffer without a
    param buffer (zero=3) takes each segment's starting values from `source(segment)` (in the params'
    dtype, so the master holds what the params would). A rule that is not elementwise (its update of a
    range is not that range of the whole matrix's) also gets, with the `mesh`, each owned view's param and
    offset and every param of the buffers with its shard axis: it rebuilds whole matrices over the axis."""
    states, segs_of, groups, pre = [], {}, {"matrix": [], "vector": []}, []
    for buf in buffers:
        n = buf.state_numel
        master = None
        if buf.dtype != torch.float32 or always_master:
            if buf.param is not None:  # made from the param buffer by make_state
                master = lazy_zeros(n, torch.float32, device)
            else:  # zeros: the padding belongs to no param (as the param buffer's zeros)
                # zero=3: the master IS the params' storage (their only copy): made now, not lazily
                master = torch.zeros(n, dtype=torch.float32, device=device)
                for seg in buf.segments:
                    master[seg.state_lo : seg.state_lo + seg.numel].copy_(source(seg))
        # The state (and a master copied from the param buffer) has no storage until make_state: torch's
        # optimizers make theirs at the first update too, so start-up holds the params only.
        st = _rule_state(buf, rule, STATE_DTYPES[cfg.state_dtype], device, master)
        states.append(st)
        for seg in buf.segments:
            lo, hi = seg.state_lo, seg.state_lo + seg.numel
            weights = buf.param[seg.buf_lo : seg.buf_lo + seg.numel] if master is None else master[lo:hi]
            grad = buf.owned_grad_at(seg)
            if grad.dtype != weights.dtype:  # bf16-reduced grads read as they are (buffer.widens_grads)
                weights.grad_dtype = None
            weights.grad = grad
            if master is not None and buf.param is not None:
                # the params' copy of the master's range: a step may write it in its pass (writes_low)
                weights.low = buf.param[seg.buf_lo : seg.buf_lo + seg.numel]
            groups["matrix" if seg.param.ndim >= 2 else "vector"].append(weights)
            pre.append((weights, st.views(seg)))
            segs_of.setdefault(seg.param, []).append((seg, weights))
    if rule.elementwise:
        update = rule.build(groups, cfg, device) if any(groups.values()) else None
    else:
        # a whole-matrix rule maps each owned view back to its param, and takes part in every matrix's
        # collectives even where it owns nothing (the same params in the same order on every rank)
        owned = {w: (seg.param, seg.param_lo) for segs in segs_of.values() for seg, w in segs}
        layout = [(p, buf.axis, rank_ranges(buf, p)) for buf in buffers for p in buf.offset]
        update = rule.build(groups, cfg, device, mesh, owned=owned, layout=layout)
    for weights, views in pre:  # the step keeps its state in our flat tensors
        update.adopt(weights, views)
    owned = [(s.param.placement, buf.owned_grad_at(s)) for buf in buffers for s in buf.segments]
    return OwnedState(states, segs_of, update, owned)


def _rule_state(buf: FlatBuffer, rule: UpdateRule, dtype: torch.dtype, device, master) -> FlatState:
    """The rule's lazy flat state of buf's owned range: per name, the whole range when every param holds it,
    else only the segments of the params that do, packed in segment order."""
    state, at = {}, {}
    for k in rule.states:
        holders = [s for s in buf.segments if k in rule.states_for(s.param.placement)]
        if len(holders) == len(buf.segments):
            state[k] = lazy_zeros(buf.state_numel, dtype, device)
            continue
        at[k] = dict(zip(map(id, holders), accumulate((0, *(s.numel for s in holders)))))
        state[k] = lazy_zeros(sum(s.numel for s in holders), dtype, device)
    return FlatState(state, master, at)


@torch.no_grad()
def make_state(buffers: list[FlatBuffer], states: list[FlatState]) -> None:
    """Give build_state's lazy state its storage: zero rule state, and a master copied from the param buffer
    (what it holds now: the params as the optimizer's first step or a load finds them). Idempotent."""
    for buf, st in zip(buffers, states):
        for t in st.state.values():
            give_storage(t)
        if buf.param is not None and give_storage(st.master):
            for b in buf.buckets:
                buf.state_shard(st.master, b).copy_(buf.shard(buf.param, b))
