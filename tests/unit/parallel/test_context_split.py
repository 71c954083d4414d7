"""Context-parallel chunking: cp rank i keeps chunks i and 2c-1-i; merge inverts it; positions and the
causal mask are the global ones."""

import pytest
import torch

from megaframe.parallel.context import cp_causal_mask, cp_keep, cp_merge, cp_positions


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_keep_then_merge_is_identity(cp):
    x_BS = torch.arange(3 * 16).view(3, 16)
    parts = [cp_keep(x_BS, r, cp) for r in range(cp)]
    assert all(p.shape == (3, 16 // cp) for p in parts)
    assert torch.equal(cp_merge(parts), x_BS)


def test_chunks_are_head_and_tail():
    x_BS = torch.arange(16)[None]
    assert cp_keep(x_BS, 0, 4).tolist() == [[0, 1, 14, 15]]
    assert cp_keep(x_BS, 1, 4).tolist() == [[2, 3, 12, 13]]
    assert cp_keep(x_BS, 3, 4).tolist() == [[6, 7, 8, 9]]


@pytest.mark.parametrize("cp", [2, 4])
def test_positions_follow_tokens_and_mask_is_causal(cp):
    seq = 16
    pos = torch.arange(seq)[None]
    for r in range(cp):
        assert torch.equal(cp_positions(seq, cp, r), cp_keep(pos, r, cp)[0])
    gathered_T = torch.cat([cp_positions(seq, cp, r) for r in range(cp)])
    for r in range(cp):
        mask_QT = cp_causal_mask(seq, cp, r)
        q_Q = cp_positions(seq, cp, r)
        full = torch.ones(seq, seq).tril().bool()  # the one-process causal mask, by global position
        assert torch.equal(mask_QT, full[q_Q][:, gathered_T])


def test_causal_work_is_balanced():
    """Every cp rank attends to the same number of (query, key) pairs: the point of the head-tail cut."""
    work = [int(cp_causal_mask(64, 4, r).sum()) for r in range(4)]
    assert len(set(work)) == 1


def test_rank_grid_puts_cp_between_tp_and_dp():
    """position = tp_rank + tp·(cp_rank + cp·(dp_rank + dp·pp_rank)); grads reduce over cp·dp."""
    from megaframe.parallel.mesh import RankGrid
    from megaframe.parallel.virtual import virtual_mesh

    g = RankGrid(tp=2, dp=2, pp=2, cp=2)
    assert g.world == 16
    assert g.position(pp_rank=1, dp_rank=1, tp_rank=1, cp_rank=1) == 1 + 2 * (1 + 2 * (1 + 2 * 1))
    assert g.groups("cp")[0] == (0, 2) and g.groups("tp")[0] == (0, 1)
    assert g.groups("dp")[0] == (0, 4) and g.groups("dpcp")[0] == (0, 2, 4, 6)
    m = virtual_mesh(2, 2, 2, tp_rank=1, pp_rank=0, dp_rank=1, device="meta", cp=2, cp_rank=1)
    assert (m.cp.size, m.cp.rank, m.dpcp.size, m.dpcp.rank, m.dp.rank) == (2, 1, 4, 3, 1)
    assert m.rank == 1 + 2 * (1 + 2 * 1)
    plain = virtual_mesh(2, 1, 2, device="meta")
    assert plain.dpcp is plain.dp and plain.cp.size == 1


def test_rank_grid_ep_borrows_from_cp_dp():
    """With tp = 1 ep cuts contiguous blocks out of the dpcp group (cp peers first), edp takes what is
    left; with cp = 1 the groups are the dp ones of before (tp > 1: test_rank_grid.py's folding)."""
    from megaframe.parallel.mesh import RankGrid
    from megaframe.parallel.virtual import virtual_mesh

    g = RankGrid(tp=1, dp=2, pp=1, cp=2, ep=2)  # positions: cp_rank + 2·dp_rank
    assert g.groups("ep") == g.groups("cp") == [(0, 1), (2, 3)]
    assert g.groups("edp") == g.groups("dp") == [(0, 2), (1, 3)]
    g4 = RankGrid(tp=1, dp=2, pp=1, cp=2, ep=4)
    assert g4.groups("ep") == g4.groups("dpcp") == [(0, 1, 2, 3)] and g4.groups("edp")[0] == (0,)
    assert RankGrid(tp=1, dp=1, pp=1, cp=2, ep=2).groups("ep") == [(0, 1)]
    assert RankGrid(tp=1, dp=4, pp=1, ep=2).groups("ep") == [(0, 1), (2, 3)]  # cp = 1: as before
    m = virtual_mesh(1, 1, 2, dp_rank=1, cp=2, cp_rank=0, ep=2)
    assert (m.ep.rank, m.edp.size, m.edp.rank) == (0, 2, 1)
    plain = virtual_mesh(1, 1, 1, cp=2, cp_rank=1)  # ep = 1: experts reduced over all of cp·dp
    assert plain.edp is plain.dpcp and plain.edp.size == 2


@pytest.mark.parametrize(
    "seq,cp,blocks",
    [(32, 2, 1), (32, 2, 2), (32, 2, 4), (48, 3, 2), (32, 1, 2), (24, 2, 3), (9, 1, 3), (5, 1, 1)],
)
def test_cp_runs_are_the_held_positions(seq, cp, blocks):
    """Each rank's rows (two cp chunks, cut into sp blocks) as runs of consecutive global positions."""
    from megaframe.parallel.context import cp_positions, cp_runs

    held = []
    for r in range(cp):
        pos = cp_positions(seq, cp, r) if cp > 1 else torch.arange(seq)  # cp = 1: any length
        m = len(pos) // blocks
        for t in range(blocks):
            runs = cp_runs(seq, cp, r, blocks, t)
            assert len(runs) == 2 and runs[0][0] == 0 and runs[0][1] == runs[1][0] and runs[1][1] == m
            for lo, hi, start in runs:
                assert torch.equal(pos[t * m : (t + 1) * m][lo:hi], torch.arange(start, start + hi - lo))
                held += range(start, start + hi - lo)
    assert sorted(held) == list(range(seq))


def test_hsdp_under_cp_cuts_the_cp_dp_ranks():
    """optim.shard_group_size=s under cp: dp_shard is s consecutive cp·dp ranks (s a multiple of cp: whole
    cp groups, replicas over dp; s < cp: inside a cp group), dp_rep the ranks at the same place of their
    block; together they cover cp·dp, so a reduce-scatter over one and an all-reduce over the other sum
    every cp·dp rank's grads."""
    from megaframe.parallel.mesh import RankGrid

    g = RankGrid(tp=2, dp=2, pp=1, cp=2, shard=2)  # positions: tp innermost, then cp, then dp
    assert g.hybrid and g.groups("dpcp") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert g.groups("dp_shard") == [(0, 2), (4, 6), (1, 3), (5, 7)]
    g = RankGrid(tp=1, dp=4, pp=1, cp=2, shard=4)
    assert g.groups("dp_shard") == [(0, 1, 2, 3), (4, 5, 6, 7)]  # two whole cp groups x two dp ranks each
    assert g.groups("dp_rep") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    g = RankGrid(tp=1, dp=2, pp=1, cp=2, shard=2)  # s = cp: a shard group is one cp group, replicas are dp
    assert g.groups("dp_shard") == g.groups("cp") == [(0, 1), (2, 3)]
    assert g.groups("dp_rep") == g.groups("dp") == [(0, 2), (1, 3)]
    g = RankGrid(tp=2, dp=1, pp=1, cp=4, shard=2)  # s < cp: halves of a cp group
    assert g.groups("dp_shard") == [(0, 2), (4, 6), (1, 3), (5, 7)]
    for s in (1, 2, 4):
        grid = RankGrid(tp=1, dp=2, pp=2, cp=2, shard=s)
        for shard in grid.groups("dp_shard"):
            reps = [r for r in grid.groups("dp_rep") if set(r) & set(shard)]
            assert sorted(x for r in reps for x in r) == sorted(grid.group_of("dpcp", shard[0]))
    assert (
        not RankGrid(tp=1, dp=2, pp=1, cp=2, shard=4).hybrid and not RankGrid(tp=1, dp=2, pp=1, cp=2).hybrid
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_dropout_mask_is_sdpa_s_draw(dtype):
    """The ring's attention-dropout mask is the one the all-gather path's SDPA (math kernel, CPU) draws
    for the same queries against the gathered K/V: attention with it equals SDPA's dropout output, and
    the generator is left where SDPA leaves it (later dropout draws agree too). Pins the premise of
    ring_attention's dropout on this torch build."""
    import torch.nn.functional as F

    from megaframe.parallel.ring_attention import dropout_keep

    b, h, k, q, t, e, p = 2, 4, 2, 8, 16, 8, 0.3
    g = torch.Generator().manual_seed(0)
    q_BHQE, k_BKTE, v_BKTE = (
        torch.randn(b, n, s, e, generator=g).to(dtype) for n, s in ((h, q), (k, t), (k, t))
    )
    mask_QT = cp_causal_mask(t, 2, 1)  # a cp rank's queries against the gathered sequence
    torch.manual_seed(5)
    ref = F.scaled_dot_product_attention(
        q_BHQE, k_BKTE, v_BKTE, attn_mask=mask_QT, dropout_p=p, enable_gqa=True
    )
    after_ref = torch.rand(4)
    torch.manual_seed(5)
    keep = dropout_keep(q_BHQE, t, p)
    after = torch.rand(4)
    assert torch.equal(after, after_ref)
    assert 0.5 < keep.float().mean() < 0.9
    kk, vv = (x.float().repeat_interleave(h // k, 1) for x in (k_BKTE, v_BKTE))
    s = (q_BHQE.float() @ kk.transpose(-1, -2) * e**-0.5).masked_fill(~mask_QT, float("-inf"))
    out = (torch.softmax(s, -1) * keep.float() / (1 - p)) @ vv
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # SDPA computes in bf16 there
    assert (out - ref.float()).abs().max() < tol
    if dtype == torch.float32:  # a different mask would differ by O(1)
        torch.manual_seed(6)
        other = (torch.softmax(s, -1) * dropout_keep(q_BHQE, t, p).float() / (1 - p)) @ vv
        assert (other - ref).abs().max() > 0.1


def test_cp_causal_bias_is_the_mask_shared_by_the_layers():
    """allgather attention passes SDPA one additive bias per (layout, dtype): 0 where the mask attends,
    -inf elsewhere, the same tensor for every layer (a bool mask is converted and saved per call)."""
    import torch

    from megaframe.parallel.context import cp_causal_bias

    mask_QT = cp_causal_mask(64, 4, 1)
    bias_QT = cp_causal_bias(64, 4, 1, torch.device("cpu"), torch.float32)
    assert torch.equal(bias_QT == 0, mask_QT) and torch.isinf(bias_QT[~mask_QT]).all()
    assert cp_causal_bias(64, 4, 1, torch.device("cpu"), torch.float32) is bias_QT
    assert cp_causal_bias(64, 4, 1, torch.device("cpu"), torch.bfloat16).dtype == torch.bfloat16
