"""Init per block: every rank draws only the blocks of the global tensor its slice touches, and every
layout (tp, pp, ep) gets the numbers of the one-process model, built here rank by rank on CPU."""

from __future__ import annotations

import pytest
import torch

from megaframe.layers import shard as shard_mod
from megaframe.layers.shard import Shard, full_init, local_init
from megaframe.parallel.virtual import virtual_mesh
from tests.distributed.cases import tiny_config
from tests.forms import build_model


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 8 x 8 (16 in 1-D), so the tiny models' tensors span many blocks and slices cut them."""
    monkeypatch.setattr(shard_mod, "BLOCK_EDGE", 8)
    monkeypatch.setattr(shard_mod, "BLOCK_1D", 16)


def assembled(overrides: list[str], tp: int, pp: int, dp: int = 1, ep: int = 1) -> dict[str, torch.Tensor]:
    """The global initial tensors, put together from every rank's own build."""
    sp = [f"parallel.sp={tp > 1}"]  # MoE with tp > 1 needs sp (config/checks.py)
    cfg = tiny_config(
        overrides + sp + [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.ep={ep}"], tp * pp * dp
    )
    out: dict[str, torch.Tensor] = {}
    for p_rank in range(pp):
        for d_rank in range(dp):
            for t_rank in range(tp):
                mesh = virtual_mesh(tp, pp, dp, t_rank, p_rank, d_rank, device="cpu", ep=ep)
                for name, p in build_model(cfg, mesh).named_parameters():
                    full = out.setdefault(name, torch.full(p.placement.shard.global_shape, float("nan")))
                    rank = mesh.ep.rank if p.placement.shard.expert and ep > 1 else t_rank
                    p.placement.shard.place(
                        full, p.detach(), rank if p.placement.shard.dim is not None else 0
                    )
    return out


LAYOUTS = [(2, 1, 1, 1), (4, 1, 1, 1), (1, 2, 1, 1), (2, 2, 1, 1)]


@pytest.mark.parametrize("tp,pp,dp,ep", LAYOUTS, ids=[f"tp{t}-pp{p}" for t, p, _, _ in LAYOUTS])
def test_init_is_identical_in_every_layout(small_blocks, tp, pp, dp, ep):
    ref = assembled([], 1, 1)
    got = assembled([], tp, pp, dp, ep)
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_expert_init_is_identical_under_ep(small_blocks):
    moe = ["model=moe_tiny"]
    ref = assembled(moe, 1, 1)
    for tp, dp, ep in ((1, 2, 2), (2, 2, 2), (1, 4, 4)):
        got = assembled(moe, tp, 1, dp, ep)
        for k in ref:
            assert torch.equal(got[k], ref[k]), (tp, ep, k)


def test_a_slice_draws_only_the_blocks_it_touches(small_blocks, monkeypatch):
    """A 64 x 48 weight in 8 x 8 blocks (8 x 6 = 48 blocks) split over 8 ranks along dim 0: each rank's
    8 rows are one block row, 6 blocks; split along dim 1 into 8-column slices: one block column, 8."""
    drawn = []
    real = shard_mod.block_seed
    monkeypatch.setattr(shard_mod, "block_seed", lambda base, i: drawn.append(i) or real(base, i))
    full = full_init("w", (64, 48), 3, 0.02, 2)
    assert len(drawn) == 48
    for dim, per_rank, size in ((0, 6, 8), (1, 8, 6)):
        for r in range(size):
            drawn.clear()
            s = Shard((64, 48), dim, (), r, size)
            assert torch.equal(local_init("w", s, 3, 0.02, 2), s.local(full))
            assert len(drawn) == per_rank
    # a fused [q | k | v] split: each rank touches its 3 row blocks' worth, nothing more
    drawn.clear()
    s = Shard((64, 48), 0, (32, 16, 16), 1, 2)
    assert torch.equal(local_init("w", s, 3, 0.02, 2), s.local(full))
    assert len(drawn) == (2 + 1 + 1) * 6


def test_default_blocks_keep_the_statistics():
    w = full_init("embed.weight", (600, 300), 1, 0.02, 2)  # crosses block edges both ways
    assert w.std().item() == pytest.approx(0.02, rel=0.03) and abs(w.mean().item()) < 1e-3
    corr = torch.corrcoef(torch.stack([w[:256, :256].flatten(), w[256:512, :256].flatten()]))[0, 1]
    assert abs(corr.item()) < 0.02  # distinct blocks are independent streams
