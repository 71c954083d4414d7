"""The Muon update rule (optim/update_rule.py): torch.optim.Muon's math on the hidden matrices, AdamW on the
rest (embeddings, head, MoE router, norms, biases: Placement.hidden_matrix is False), optim.muon its keys.

Per hidden matrix: momentum (elementwise, optionally Nesterov), then torch's Newton-Schulz orthogonalisation
of the whole matrix, then decoupled weight decay and the update at torch's shape-adjusted lr. The matrices are
the logical ones, as torch would see them on separate weights: each block of a fused weight (q, k, v of QKV;
gate, up of gate/up: Placement.matrix_rows) and each expert of a stacked expert weight. A tensor-parallel
slice is gathered over tp for the orthogonalisation (every tp rank runs it, then keeps its own rows/columns);
experts split over ep are whole on their rank. The update needs whole matrices (`elementwise=False`): under
ZeRO each rank updates the momentum of its owned ranges and sends their direction to the matrix's owner
(one rank of the shard axis, balanced by Newton-Schulz work: `_owners`), which orthogonalises the whole
matrix and sends each rank back its ranges of the result (muon_exchange.py: bytes per rank follow its
share), and each rank applies its ranges of the update (MuonStep).
"""

from __future__ import annotations

import math
from itertools import accumulate

import torch

# torch's own Newton-Schulz and lr adjustment, so the math is the reference's bit for bit
# (tests/unit/optim/test_muon.py). Private: torch's public API is the Muon optimizer class only, which
# steps whole 2-D params it owns; here the matrix is a tp-gathered block of a fused weight or one expert
# of a stacked one, and ZeRO owns flat ranges of it. A torch that moves them fails this import at once.
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from megaframe.config.schema import OptimConfig
from megaframe.layers.shard import gather_full
from megaframe.optim.adamw import MOMENTS, AdamWStep
from megaframe.optim.muon_exchange import from_owners, to_owners
from megaframe.optim.update_rule import STATE_DTYPES, Groups, RuleStep, UpdateRule

MOMENTUM = "momentum_buffer"
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""torch.optim.Muon's defaults (Keller Jordan's quintic iteration) and its eps of the normalisation."""
NS_EPS = 1e-7


def _blocks(p: torch.Tensor) -> list[tuple[int, int, int]]:
    """(local row offset, local rows, global rows) of each logical matrix along dim 0 of p's local slice (of
    each expert's matrix): a tp split along rows holds a slice of every fused block, side by side."""
    pl = p.placement
    if pl.shard.dim == 0 and not pl.expert:
        return [(lo, n, g) for (_, lo, n), g in zip(pl.shard.ranges(), pl.matrix_rows)]
    rows = pl.matrix_rows
    return [(lo, n, n) for lo, n in zip(accumulate((0, *rows[:-1])), rows)]


class MuonStep(RuleStep):
    """Momentum per hidden matrix (optim.state_dtype, widened to fp32 for the update), an AdamWStep on the
    rest at optim.muon.adamw_lr on optim.lr's schedule.

    A strategy passing whole params (zero=0) gives neither `owned` nor `layout`. ZeRO passes `owned` (each
    flat view it owns -> its param and offset in the param's flat local tensor) and `layout` (every param
    with the axis its ranges are cut over and every axis rank's range of it, the same order on every rank):
    each rank updates the momentum of its ranges and sends their direction to the matrix's owner, which
    orthogonalises the whole matrix and sends each rank its ranges of the result; every rank applies them."""

    def __init__(
        self, groups: Groups, cfg: OptimConfig, device: torch.device, mesh=None, owned=None, layout=None
    ):
        self.cfg, self.mesh, self.dtype = cfg, mesh, STATE_DTYPES[cfg.state_dtype]
        views = [w for ps in groups.values() for w in ps]
        # a dict of tensors: keyed by identity (their hash is their id)
        self.owned = owned if owned is not None else {w: (w, 0) for w in views}
        hidden = [w for w in views if self.owned[w][0].placement.hidden_matrix]
        self._hidden = set(hidden)
        rest = {k: [w for w in ps if w not in self._hidden] for k, ps in groups.items()}
        self.adam = AdamWStep(rest, cfg, device) if any(rest.values()) else None
        # every hidden matrix, with the axis its ranges are cut over (None: whole on this rank) and each
        # axis rank's range of it (muon_exchange.rank_ranges)
        layout = layout if layout is not None else [(w, None, None) for w in hidden]
        self.matrices = [(p, axis) for p, axis, _ in layout if p.placement.hidden_matrix]
        self.ranges = {p: r for p, _, r in layout}
        self.segs: dict[torch.Tensor, list[tuple[torch.Tensor, int]]] = {p: [] for p, _ in self.matrices}
        for w in hidden:
            p, lo = self.owned[w]
            self.segs[p].append((w, lo))
        self.owner = _owners(self.matrices)
        # the matrices cut over each shard axis, in layout order (the same on every rank of the axis)
        self.by_axis: dict[tuple, tuple] = {}
        for p, axis in self.matrices:
            if axis is not None:
                self.by_axis.setdefault(axis.ranks, (axis, []))[1].append(p)
        adamw_lr = cfg.muon.adamw_lr if cfg.muon.adamw_lr is not None else cfg.lr
        # the AdamW part follows optim.lr's schedule (warmup, decay) scaled to its own peak
        self.adamw_scale = adamw_lr / cfg.lr if cfg.lr else 0.0
        self.momentum: dict[torch.Tensor, torch.Tensor] = {}

    def adopt(self, weights: torch.Tensor, views: dict[str, torch.Tensor]) -> None:
        if weights in self._hidden:
            self.momentum[weights] = views[MOMENTUM]
        else:
            self.adam.adopt(weights, views)

    def state_of(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        if weights in self._hidden:
            return {MOMENTUM: self.momentum[weights]} if weights in self.momentum else {}
        return self.adam.state_of(weights)

    def set_step(self, weights: torch.Tensor, step: int) -> None:
        # Muon keeps no step count (no bias correction): only AdamW's parameters read one
        if weights not in self._hidden:
            self.adam.set_step(weights, step)

    def writes_low(self, weights: torch.Tensor) -> bool:
        return weights not in self._hidden and self.adam.writes_low(weights)

    def step(self, lr: float, divisor: torch.Tensor | None, skip: torch.Tensor) -> None:
        if self.adam is not None:
            self.adam.step(lr * self.adamw_scale, divisor, skip)
        skip = skip.bool()
        for p, axis in self.matrices:
            if axis is None and self.segs[p] and self.segs[p][0][0].grad is not None:
                direction = self._direction(p, divisor, skip)
                self._apply(p, self._orthogonalised(p, direction.view(p.shape)).view(-1), lr, skip)
        for axis, mats in self.by_axis.values():
            self._step_sharded(axis, mats, lr, divisor, skip)

    @torch.no_grad()
    def _step_sharded(self, axis, mats: list, lr: float, divisor, skip: torch.Tensor) -> None:
        """The matrices cut over `axis`: each rank's ranges of their directions to their owners, which
        orthogonalise them, and each rank's ranges of the results back (muon_exchange.py)."""
        dev = self.mesh.device
        pieces = {p: self._direction(p, divisor, skip) for p in mats if self.segs[p]}
        whole = to_owners(axis, mats, self.ranges, self.owner, pieces, dev)
        # in mats order: an owner's tp peers own the same matrices and gather them over tp in this order
        results = {p: self._orthogonalised(p, d.view(p.shape)).view(-1) for p, d in whole.items()}
        mine = from_owners(axis, mats, self.ranges, self.owner, results, dev)
        for p in mats:
            if self.segs[p]:
                self._apply(p, mine[p], lr, skip)

    @torch.no_grad()
    def _direction(self, p: torch.Tensor, divisor, skip: torch.Tensor) -> torch.Tensor:
        """Momentum of this rank's range of p updated (not where skip is 1); returns the range's direction
        (flat fp32). A parameter lies in one bucket: a rank owns one range of it at most."""
        m, ((w, _),) = self.cfg.muon, self.segs[p]
        grad = w.grad.float() if divisor is None else w.grad.float() / divisor
        if w not in self.momentum:  # made at the first update, as torch's
            self.momentum[w] = torch.zeros_like(w, dtype=self.dtype)
        buf = self.momentum[w].float()
        # where skip is 1 (a non-finite norm) nothing changes, chosen on the device without a host sync
        buf = torch.where(skip, buf, buf.lerp(grad, 1 - m.momentum))
        self.momentum[w].copy_(buf)
        return (grad.lerp(buf, m.momentum) if m.nesterov else buf).reshape(-1)

    @torch.no_grad()
    def _apply(self, p: torch.Tensor, update: torch.Tensor, lr: float, skip: torch.Tensor) -> None:
        """Decay and the orthogonalised update of this rank's range of p (`update`: that range, flat), each
        logical matrix at its shape-adjusted lr."""
        ((w, lo),) = self.segs[p]
        new = w * (1 - lr * self.cfg.weight_decay)
        flat_new = new.view(-1)
        for a, b, alr in _block_ranges(p, lr, self.cfg.muon.adjust_lr_fn.value):
            a, b = max(a, lo), min(b, lo + w.numel())
            if a < b:
                flat_new[a - lo : b - lo].add_(update[a - lo : b - lo], alpha=-alr)
        w.copy_(torch.where(skip, w, new))

    def _orthogonalised(self, p: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
        """torch's Newton-Schulz of each logical matrix of the whole (tp-gathered) tensor, p's slice of it
        (fp32 holding torch's bf16 result exactly)."""
        pl = p.placement
        gathered = pl.tp_split and self.mesh is not None and self.mesh.tp.size > 1
        full = gather_full(direction, pl.shard, self.mesh.tp) if gathered else direction
        out = torch.empty_like(full)
        for full_m, out_m in zip(full.unbind(0), out.unbind(0)) if pl.expert else [(full, out)]:
            lo = 0
            for rows in pl.matrix_rows:
                block = full_m.narrow(0, lo, rows)
                ns = _zeropower_via_newtonschulz(block, NS_COEFFICIENTS, self.cfg.muon.ns_steps, NS_EPS)
                out_m.narrow(0, lo, rows).copy_(ns)
                lo += rows
        return pl.shard.local(out) if gathered else out

    def held(self) -> list[torch.Tensor]:
        return list(self.momentum.values()) + (self.adam.held() if self.adam is not None else [])


def _ns_cost(p: torch.Tensor) -> int:
    """Newton-Schulz work of p's whole (tp-gathered) logical matrices: rows x cols x min(rows, cols) each."""
    pl = p.placement
    cols = pl.shard.global_shape[-1]
    return (p.shape[0] if pl.expert else 1) * sum(r * cols * min(r, cols) for r in pl.matrix_rows)


def _owners(matrices: list) -> dict:
    """The rank of its axis that orthogonalises each matrix cut over an axis: the costliest first, each to
    the least loaded rank so far (the same order and result on every rank of the axis)."""
    load: dict[tuple, list[int]] = {}
    owner = {}
    ranked = sorted((m for m in matrices if m[1] is not None), key=lambda m: -_ns_cost(m[0]))
    for p, axis in ranked:
        work = load.setdefault(axis.ranks, [0] * axis.size)
        owner[p] = work.index(min(work))
        work[owner[p]] += _ns_cost(p)
    return owner


def _block_ranges(p: torch.Tensor, lr: float, adjust: str) -> list[tuple[int, int, float]]:
    """[start, end) in p's flat local tensor of each logical matrix's local rows, and its adjusted lr (by
    the logical matrix's global shape, as torch's on a separate weight)."""
    cols, local_cols = p.placement.shard.global_shape[-1], p.shape[-1]
    # from the shape only: a ZeRO-3 param's storage may be freed between its gathers
    per = math.prod(p.shape[1:]) if p.placement.expert else 0
    out = []
    for e in range(p.shape[0] if p.placement.expert else 1):
        for lo, n, rows in _blocks(p):
            start = e * per + lo * local_cols
            out.append((start, start + n * local_cols, _adjust_lr(lr, adjust, (rows, cols))))
    return out


RULE = UpdateRule(
    name="muon",
    states=(MOMENTUM, *MOMENTS),
    state_bytes={"fp32": (4, 4, 4), "bf16": (2, 2, 2)},
    elementwise=False,
    build=MuonStep,
    kinds={"hidden": (MOMENTUM,), "other": MOMENTS},
)
