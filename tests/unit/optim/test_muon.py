"""optim.name=muon on one process (optim/muon.py) against torch.optim.Muon: the model's hidden matrices split
into the logical ones torch would hold as separate weights (q, k, v of the fused QKV; gate, up; each MoE
expert), torch's Muon on those and torch's AdamW on the rest (embedding, head, router, norms), the same
grads for 5 steps."""

from __future__ import annotations

import pytest
import torch

from megaframe.optim.build import build_optimizer
from megaframe.parallel.mesh import single_process_mesh
from tests.distributed.cases import tiny_config
from tests.forms import build_model

STEPS = 5
MOE = ["model=moe_tiny", "model.num_experts=4", "model.moe_ffn_hidden_size=48", "model.moe_top_k=1"]


def _grads(model, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {n: torch.randn(p.shape, generator=g) * 0.1 for n, p in model.named_parameters()}


def _pieces(p: torch.Tensor) -> list[tuple[int | None, int, int]]:
    """(expert or None, first row, rows) of each logical matrix of a hidden weight (one process: whole)."""
    experts = range(p.shape[0]) if p.placement.expert else [None]
    out = []
    for e in experts:
        lo = 0
        for rows in p.placement.matrix_rows:
            out.append((e, lo, rows))
            lo += rows
    return out


def _view(t: torch.Tensor, e, lo: int, n: int) -> torch.Tensor:
    return (t if e is None else t[e]).narrow(0, lo, n)


def _reference(model, cfg, lr: float):
    """torch's Muon and AdamW on separate leaf tensors (the logical matrices), stepped with the same grads;
    returns the weights reassembled by parameter name."""
    o, m = cfg.optim, cfg.optim.muon
    muon_leaves, decay, no_decay, where = [], [], [], []
    for name, p in model.named_parameters():
        if p.placement.hidden_matrix:
            for e, lo, n in _pieces(p):
                leaf = _view(p.detach(), e, lo, n).clone().requires_grad_(True)
                muon_leaves.append(leaf)
                where.append((name, e, lo, n, leaf))
        else:
            leaf = p.detach().clone().requires_grad_(True)
            (decay if p.ndim >= 2 else no_decay).append(leaf)
            where.append((name, None, 0, p.shape[0], leaf))
    muon = torch.optim.Muon(
        muon_leaves,
        lr=lr,
        weight_decay=o.weight_decay,
        momentum=m.momentum,
        nesterov=m.nesterov,
        ns_steps=m.ns_steps,
        adjust_lr_fn=m.adjust_lr_fn.value,
    )
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=m.adamw_lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
    for step in range(STEPS):
        grads = _grads(model, step)
        for name, e, lo, n, leaf in where:
            leaf.grad = _view(grads[name], e, lo, n).clone()
        muon.step()
        adamw.step()
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, e, lo, n, leaf in where:
        _view(out[name], e, lo, n).copy_(leaf.detach())
    return out


@pytest.mark.parametrize(
    "over",
    [
        ["optim.muon.adjust_lr_fn=match_rms_adamw"],
        ["optim.muon.nesterov=false", "optim.muon.momentum=0.9", "optim.muon.ns_steps=4"],
    ],
)
def test_muon_equals_torchs_muon_on_the_logical_matrices(over):
    lr = 0.02
    cfg = tiny_config(
        MOE
        + ["optim.zero=0", "optim.clip_grad=0", "optim.name=muon", f"optim.lr={lr}"]
        + ["optim.muon.adamw_lr=3e-3"]
        + over,
        1,
    )
    model = build_model(cfg, single_process_mesh())
    names = dict(model.named_parameters())
    # what goes where: the fused blocks and experts are orthogonalised apart; embedding, head, router to AdamW
    assert names["layers.0.attn.qkv.weight"].placement.matrix_rows == (64, 32, 32)
    assert names["layers.0.mlp.experts.up_proj.weight"].placement.matrix_rows == (48, 48)
    kinds = {n for n, p in names.items() if p.placement.hidden_matrix}
    assert not kinds & {"embed.weight", "head.weight", "layers.0.mlp.router.weight"}
    ref = _reference(model, cfg, lr)
    opt = build_optimizer(model, cfg.optim, single_process_mesh())
    for step in range(STEPS):
        for n, g in _grads(model, step).items():
            names[n].grad = g
        opt.step(lr)
    worst = 0.0
    for n, p in names.items():
        diff = ((p.detach() - ref[n]).abs().max() / ref[n].abs().max()).item()
        worst = max(worst, diff)
    print(f"muon vs torch.optim.Muon after {STEPS} steps: max rel diff {worst:.2e}")
    assert worst <= 1e-6, worst
    # the state each kind holds: momentum on the hidden matrices, AdamW's two moments on the rest
    for n, p in names.items():
        assert set(opt.logical_state(p)) == set(opt.rule.states_for(p.placement)), n


def test_each_summed_matrix_is_orthogonalised_by_one_rank_balanced_by_work():
    """Under ZeRO one rank of the axis runs a matrix's Newton-Schulz (rows x cols x min work), the costliest
    first to the least loaded rank: the same owners on every rank, the work split near evenly."""
    from types import SimpleNamespace

    from megaframe.layers.shard import Shard
    from megaframe.optim.muon import _ns_cost, _owners
    from megaframe.parallel.placement import Placement

    def matrix(rows, cols):
        p = torch.nn.Parameter(torch.empty(rows, cols))
        p.placement = Placement(Shard((rows, cols), 0, (rows,)))
        return p

    axis = SimpleNamespace(ranks=(0, 1), size=2)
    mats = [(matrix(64, 64), axis), (matrix(32, 64), axis), (matrix(32, 64), axis), (matrix(8, 8), None)]
    owner = _owners(mats)
    assert mats[3][0] not in owner  # whole on this rank: no owner to pick
    assert [owner[p] for p, _ in mats[:3]] == [0, 1, 1]
    work = [sum(_ns_cost(p) for p, _ in mats[:3] if owner[p] == r) for r in (0, 1)]
    assert work == [64 * 64 * 64, 2 * 32 * 64 * 32]


def test_each_ranks_muon_bytes_follow_its_share_of_the_matrices():
    """Under ZeRO a rank sends its ranges of the matrices others own and, as an owner, the others' ranges of
    its matrices back: the bytes each rank sends (counted by comm's CommStats on a virtual dp axis of 4)
    equal that, against the all-reduce of every whole matrix plus its owner's broadcast before."""
    from megaframe.layers.shard import Shard
    from megaframe.optim.buffer import FlatBuffer
    from megaframe.optim.muon import _owners
    from megaframe.optim.muon_exchange import from_owners, rank_ranges, to_owners
    from megaframe.parallel.flight import CommStats
    from megaframe.parallel.mesh import Axis
    from megaframe.parallel.placement import Placement

    n, shapes = 4, [(48, 40), (64, 32), (100, 7), (30, 30), (16, 16)]
    mats = [torch.nn.Parameter(torch.empty(s)) for s in shapes]
    for p in mats:
        p.placement = Placement(Shard(tuple(p.shape), 0, (p.shape[0],)))
    # 2 KiB buckets of fp32 grads: params straddle ranks' ranges, and a rank owns none of some
    ranges = {p: rank_ranges(FlatBuffer(mats, 2048, 0, n, set()), p) for p in mats}
    for p in mats:
        assert sum(k for _, k in ranges[p]) == p.numel()
    for r in range(n):
        axis = Axis("dp", n, r, tuple(range(n)), None, CommStats(), virtual=True)
        owner = _owners([(p, axis) for p in mats])
        pieces = {p: torch.zeros(ranges[p][r][1]) for p in mats if ranges[p][r][1]}
        whole = to_owners(axis, mats, ranges, owner, pieces, "cpu")
        assert {id(p) for p in whole} == {id(p) for p in mats if owner[p] == r}
        back = from_owners(axis, mats, ranges, owner, whole, "cpu")
        assert {id(p): t.numel() for p, t in back.items()} == {id(p): t.numel() for p, t in pieces.items()}
        mine = sum(ranges[p][r][1] for p in mats if owner[p] != r)
        theirs = sum(p.numel() - ranges[p][r][1] for p in mats if owner[p] == r)
        assert axis.stats.sent["dp"] == 4 * (mine + theirs)
        before = sum(2 * (n - 1) / n * 4 * p.numel() + (4 * p.numel() if owner[p] == r else 0) for p in mats)
        assert 4 * (mine + theirs) < before / 2, (r, mine + theirs, before)
