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
