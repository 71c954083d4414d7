"""The ZeRO buffer layout: bucket packing and padding, and dp ranges that cover every element once."""

import pytest
import torch
from torch import nn

from megaframe.optim.buffer import FlatBuffer, plan_buckets

SHAPES = [(7, 5), (3,), (11, 4), (1,), (6, 6), (13,), (2, 9)]


def fresh_params():
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def test_plan_buckets_packs_whole_params_and_pads_to_dp():
    plan = plan_buckets([5, 3, 10, 1], bucket_elems=8, dp=4)
    assert plan == [([0, 1], 0, 8), ([2], 8, 20), ([3], 20, 24)]
    assert plan_buckets([5, 3], bucket_elems=100, dp=3) == [([0, 1], 0, 9)]


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_bytes", [4 * 20, 4 * 1000])
def test_ranges_cover_every_element_exactly_once(dp, bucket_bytes):
    covered = {i: torch.zeros(torch.Size(s).numel(), dtype=torch.int32) for i, s in enumerate(SHAPES)}
    for rank in range(dp):
        params = fresh_params()
        values = [p.detach().clone() for p in params]
        buf = FlatBuffer(params, bucket_bytes, rank, dp, late=set())
        assert buf.numel % dp == 0 and all(b.numel % dp == 0 for b in buf.buckets)
        state = torch.zeros(buf.state_numel, dtype=torch.int32)
        for seg in buf.segments:
            i = next(k for k, p in enumerate(params) if p is seg.param)
            covered[i][seg.param_lo : seg.param_lo + seg.numel] += 1
            state[seg.state_lo : seg.state_lo + seg.numel] += 1
            # the segment's buffer elements are the param's elements
            assert torch.equal(
                buf.param[seg.buf_lo : seg.buf_lo + seg.numel],
                seg.param.detach().reshape(-1)[seg.param_lo : seg.param_lo + seg.numel],
            )
        assert state.max() <= 1  # segments never share rank state
        for p, v in zip(params, values):  # params now live in the buffer, values kept
            assert torch.equal(p.detach(), v)
            assert buf.param_view(p).data_ptr() == p.data_ptr()
            assert p.main_grad.data_ptr() == buf.grad_view(p).data_ptr()
    for i, c in covered.items():
        assert torch.equal(c, torch.ones_like(c)), (i, c)


def test_buckets_follow_reverse_parameter_order():
    params = fresh_params()
    buf = FlatBuffer(params, 4 * 40, 0, 2, late={id(params[0])})
    order = [p for b in buf.buckets for p in b.params]
    assert order == params[::-1]
    assert [b.late for b in buf.buckets][-1] and not buf.buckets[0].late  # params[0] sits in the last bucket


def test_bf16_master_follows_params_written_from_outside():
    """Weights loaded without optimizer state (an import) must not be overwritten by a stale master."""
    from megaframe.config import OptimConfig
    from megaframe.layers.shard import Shard, sharded_param
    from megaframe.optim.zero import ZeroOptimizer
    from megaframe.parallel.mesh import single_process_mesh

    model = nn.Module()
    model.w = sharded_param(Shard((4, 3)), "cpu")
    model.b = sharded_param(Shard((3,)), "cpu")
    with torch.no_grad():
        model.w.fill_(1.0)
        model.b.fill_(2.0)
    model.to(torch.bfloat16)
    opt = ZeroOptimizer(model, OptimConfig(weight_decay=0.0, bucket_size_mb=1e-5), single_process_mesh())
    with torch.no_grad():  # an import writes the params after the optimizer exists
        model.w.copy_(torch.full((4, 3), 3.0))
    opt.zero_grad()
    (model.w.float().sum() + model.b.float().sum()).backward()
    opt.step(0.0)  # lr 0: the params must stay what was written
    assert torch.equal(model.w.detach(), torch.full((4, 3), 3.0, dtype=torch.bfloat16))
    assert torch.equal(model.b.detach(), torch.full((3,), 2.0, dtype=torch.bfloat16))
    opt.zero_grad()
    (model.w.float().sum() + model.b.float().sum()).backward()
    opt.step(0.1)  # an Adam step moves every element by ~lr
    assert torch.allclose(model.w.detach().float(), torch.full((4, 3), 2.9), atol=0.02)


@pytest.mark.parametrize("zero,dtype", [(1, torch.float32), (2, torch.bfloat16)])
def test_grads_and_moments_are_made_lazily(zero, dtype):
    """Start-up holds the params only (as torch's AdamW): the grads and moments are made at the first
    zero_grad, or by a backward, save or step before one; every path gives the same update."""
    from megaframe.config import OptimConfig
    from megaframe.layers.shard import Shard, sharded_param
    from megaframe.optim.zero import ZeroOptimizer
    from megaframe.parallel.mesh import single_process_mesh

    def make():
        model = nn.Module()
        model.w = sharded_param(Shard((4, 3)), "cpu")
        model.b = sharded_param(Shard((3,)), "cpu")
        with torch.no_grad():
            model.w.copy_(torch.arange(12.0).reshape(4, 3))
            model.b.fill_(2.0)
        model.to(dtype)
        return model, ZeroOptimizer(model, OptimConfig(zero=zero, bucket_size_mb=1e-5), single_process_mesh())

    def loss(model):
        return (model.w.float() ** 2).sum() + (model.b.float() * 3).sum()

    results = []
    for path in ("zero_grad", "backward", "save"):
        model, opt = make()
        mem = opt.memory_bytes()
        assert mem["mem/grads_bytes"] == 0 and mem["mem/optim_bytes"] == 0, mem
        if path == "zero_grad":
            opt.zero_grad()
            assert opt.memory_bytes()["mem/optim_bytes"] > 0
        if path == "save":  # a save before any step writes zero moments
            for p in (model.w, model.b):
                for *_, views in opt.state_segments(p):
                    assert not views["exp_avg"].any() and not views["exp_avg_sq"].any()
        loss(model).backward()
        assert opt.memory_bytes()["mem/grads_bytes"] > 0
        opt.step(0.1)
        results.append([p.detach().clone() for p in (model.w, model.b)])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
