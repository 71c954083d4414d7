"""Dropout under tensor parallelism (layers/rng.py): without sp the residual stream is a replica on
every tp rank, and with dropout > 0 the replicas must stay identical (the masks agree); activation
recompute must replay the tp-distinct masks (attention heads, sp sequence blocks) exactly."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.distributed

DROPOUT = ["model.dropout=0.1"]


def replica_spread(mesh, overrides: list[str], steps: int, run_dir: str) -> dict | None:
    """Train with the real trainer loop (its per-step seeding); rank 0 returns the largest difference
    between the tp ranks' block outputs and replicated (norm) weights."""
    from megaframe.runops.signals import StopFlag
    from megaframe.training import trainer
    from tests.distributed.cases import tiny_config

    cfg = tiny_config(
        overrides
        + [
            f"train.max_steps={steps}",
            f"train.log_interval={steps}",
            "train.hang_timeout_s=0",
            f"run.dir={run_dir}",
            f"checkpoint.dir={run_dir}/checkpoints",
        ],
        mesh.world,
    )
    outs, seen = [], {}
    real = trainer.optimizer_step

    def hooked(model, *args, **kwargs):
        if not seen:
            seen["model"] = model
            for block in model.layers.values():
                block.register_forward_hook(lambda m, i, o: outs.append(o.detach().clone()))
        return real(model, *args, **kwargs)

    with mock.patch.object(trainer, "optimizer_step", hooked):
        trainer.train(cfg, mesh, StopFlag())
    norms = {n: p.detach() for n, p in seen["model"].named_parameters() if "norm" in n}
    mine = (torch.stack([o.flatten() for o in outs]), norms)
    both = [None] * mesh.tp.size
    dist.all_gather_object(both, mine, group=mesh.tp.group)
    if mesh.rank != 0:
        return None
    (a_out, a_norm), (b_out, b_norm) = both
    return {
        "outputs": (a_out - b_out).abs().max().item(),
        "outputs_scale": a_out.abs().max().item(),
        "norms": max((a_norm[n] - b_norm[n]).abs().max().item() for n in a_norm),
    }


def recompute_losses(mesh, overrides: list[str], steps: int) -> list[float] | None:
    """Losses of `steps` steps seeded as the trainer seeds them."""
    from megaframe.layers.rng import seed_step
    from megaframe.optim.build import build_optimizer
    from megaframe.parallel import comm
    from tests.distributed.cases import tiny_config
    from tests.forms import build_data, build_model, microbatches, train_step

    cfg = tiny_config(overrides + [f"train.max_steps={steps}"], mesh.world)
    model = build_model(cfg, mesh)
    optimizer, data, t = build_optimizer(model, cfg.optim, mesh), build_data(cfg), cfg.train
    losses = []
    for step in range(1, steps + 1):
        seed_step(t.seed, step, mesh)
        batches = microbatches(
            data, step - 1, t.global_batch_size, t.micro_batch_size, mesh.dp.rank, mesh.dp.size, t.seed
        )
        res = train_step(model, optimizer, batches, mesh, cfg, step)
        losses.append(comm.all_reduce(res.loss_sum.clone(), mesh.dp).item())
    return losses if mesh.rank == 0 else None


def test_tp2_replicas_stay_identical_with_dropout(pool, tmp_path):
    got = pool.run(replica_spread, 2, DROPOUT + ["parallel.tp=2"], 3, str(tmp_path), tp=2)[0]
    assert got["outputs_scale"] > 0
    assert got["outputs"] == 0.0 and got["norms"] == 0.0, got


_reference: list = []


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_tp2_sp_recompute_replays_dropout(pool, recompute):
    over = DROPOUT + ["parallel.tp=2", "parallel.sp=true"]
    if not _reference:
        _reference.append(pool.run(recompute_losses, 2, over, 2, tp=2)[0])
    ref = _reference[0]
    got = pool.run(recompute_losses, 2, over + [f"train.recompute={recompute}"], 2, tp=2)[0]
    assert got == ref, (got, ref)
