"""Functions the rank pool runs: fn(mesh, *args). Module-level so spawned workers can import them."""
from __future__ import annotations

import torch

from megaframe.config import load_config
from megaframe.data.dataset import build_data, microbatches
from megaframe.layers.shard import gather_full
from megaframe.model.gpt import build_model
from megaframe.optim.build import build_optimizer
from megaframe.parallel import comm
from megaframe.training.step import train_step

TINY = ["data=synthetic", "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=8",
        "model.num_query_groups=4", "model.ffn_hidden_size=128", "model.seq_length=32", "model.vocab_size=256",
        "train.global_batch_size=8", "train.micro_batch_size=2", "optim.warmup_steps=2", "optim.lr=3e-3",
        "logging.wandb.mode=disabled"]


def tiny_config(overrides: list[str], world: int):
    return load_config(TINY + list(overrides), world_size=world, check_data=False)


def full_state(model, mesh, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its grad) as the full global tensor."""
    return {n: gather_full(p.grad if grads else p.data, p.shard, mesh.tp) for n, p in model.named_parameters()}


def train_and_report(mesh, overrides: list[str], steps: int) -> dict | None:
    """Run `steps` optimizer steps; rank 0 returns losses, step-1 grads, final weights (full tensors)."""
    cfg = tiny_config(overrides + [f"train.max_steps={steps}"], mesh.world)
    model = build_model(cfg.model, mesh, cfg.parallel.sp, cfg.train.seed)
    optimizer = build_optimizer(model, cfg.optim, mesh.device)
    data = build_data(cfg)
    t = cfg.train
    losses, grads, comm_tp = [], None, []
    for step in range(1, steps + 1):
        batches = microbatches(data, step - 1, t.global_batch_size, t.micro_batch_size, mesh.dp.rank,
                               mesh.dp.size, t.seed)
        mesh.stats.pop()
        res = train_step(model, optimizer, batches, mesh, cfg, step)
        comm_tp.append(dict(mesh.stats.pop()))
        loss = comm.all_reduce(res.loss_sum.clone(), mesh.dp) / (t.global_batch_size * cfg.model.seq_length)
        losses.append(loss.item())
        if step == 1:
            grads = full_state(model, mesh, grads=True)
    weights = full_state(model, mesh)
    if mesh.rank != 0:
        return None
    return {"losses": losses, "grads": grads, "weights": weights, "comm": comm_tp}
