"""train.compile=true compiles each block's forward, not its module call: ZeRO's hooks on the block (ZeRO-1's
parameter-gather wait, ZeRO-3's gather / release around forward and backward) run eagerly around the graph
and are never traced into it. Counted by dynamo's own counters over two steps of 2 micro-batches: one graph
for every block (the blocks are alike), no graph break, no recompile. Before: ZeRO-1's @eager pre-hook
broke every block call at its entry (even at a shard size of 1, where it has nothing to wait for), and
ZeRO-3's hooks were traced (collectives, waits, storage resizes: several graphs and breaks per block).
The graphs are counted with the aot_eager backend: what dynamo captures is the same as under inductor,
without its CPU compile time."""

import functools

import pytest
import torch
from torch._dynamo.utils import counters

from megaframe.optim.build import build_optimizer
from megaframe.parallel.mesh import single_process_mesh
from tests.distributed.cases import tiny_config
from tests.forms import build_data, build_model, microbatches, train_step


@pytest.mark.parametrize("zero", [1, 3])
def test_one_graph_per_block_kind_no_breaks_under_zero(zero, monkeypatch):
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    over = ["train.precision=bf16", "train.compile=true", f"optim.zero={zero}", "model.num_layers=2"]
    shape = ["model.seq_length=16", "train.global_batch_size=4", "train.micro_batch_size=2"]
    cfg = tiny_config(over + shape, 1)
    mesh = single_process_mesh()
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = build_model(cfg, mesh)
    opt = build_optimizer(model, cfg.optim, mesh)
    t, data = cfg.train, build_data(cfg)
    for s in range(2):
        batches = microbatches(data, s, t.global_batch_size, t.micro_batch_size, 0, 1, t.seed)
        train_step(model, opt, batches, mesh, cfg, s + 1)
    breaks = sum(counters["graph_break"].values())
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert breaks == 0, dict(counters["graph_break"])
    assert not counters["recompiles"], dict(counters["recompiles"])


def test_an_fp32_moe_model_compiles_and_steps_like_eager(monkeypatch):
    """train.compile=true on an MoE model in fp32 on the CPU, two steps: eager's losses and grad norms. The
    experts' frame after the dispatcher's host sync is traced too, where torch._grouped_mm's fake kernel
    takes bf16 alone, so the experts run the padded path there (moe/grouped.py's grouped_supported;
    before, the trace failed: "Expected inputs of BF16 type"); and the router losses' seed reaches the
    router under AOT autograd (moe/layer.py's _InjectLoss returns a new tensor when compiled: its view of
    y was rebuilt outside the graph and the seed lost, the router's grads 30-90 % off, the grad norm 4e-4)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    over = ["model=moe_tiny", "model.num_layers=2", "model.seq_length=16", "train.global_batch_size=2"]
    losses = []
    for compiled in (False, True):
        cfg = tiny_config(over + ["train.micro_batch_size=1", f"train.compile={str(compiled).lower()}"], 1)
        mesh = single_process_mesh()
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build_model(cfg, mesh)
        opt = build_optimizer(model, cfg.optim, mesh)
        t, data = cfg.train, build_data(cfg)
        got = []
        for s in range(2):
            batches = microbatches(data, s, t.global_batch_size, t.micro_batch_size, 0, 1, t.seed)
            res = train_step(model, opt, batches, mesh, cfg, s + 1)
            got.append((res.loss_sum.item(), res.grad_norm.item()))
        losses.append(got)
    assert [x for s in losses[1] for x in s] == pytest.approx([x for s in losses[0] for x in s], rel=1e-5), (
        losses
    )
