"""Functions the rank pool runs: fn(mesh, *args). Module-level so spawned workers can import them."""

from __future__ import annotations

import torch

from megaframe.config import load_config
from megaframe.layers.shard import gather_full
from megaframe.model.moe import stats as moe_stats
from megaframe.optim.build import build_optimizer
from megaframe.parallel import comm
from tests.forms import build_data, build_model, microbatches, train_step

TINY = [
    "data=synthetic",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=128",
    "model.seq_length=32",
    "model.vocab_size=256",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
    "logging.wandb.mode=disabled",
]


def tiny_config(overrides: list[str], world: int, base: list[str] | None = None):
    """TINY (or `base`) under `overrides`."""
    return load_config((TINY if base is None else base) + list(overrides), world_size=world, check_data=False)


def job_config(mesh, overrides: list[str], base: list[str] | None = None):
    """tiny_config for every rank of a pool job, composed once: rank 0 composes it and the others receive
    it (or its error). Hydra's composition is most of a tiny job's CPU (~0.13 s a rank, three steps of a
    2-layer model less), and every rank composed the same config from the same options."""
    try:
        mine = tiny_config(overrides, mesh.world, base) if mesh.rank == 0 else None
    except Exception as e:  # every rank raises it: the others must not wait for a config that never comes
        mine = e
    cfg = comm.broadcast_object(mine, mesh)
    if isinstance(cfg, Exception):
        raise cfg
    return cfg


def full_state(model, mesh, grads: bool = False, optimizer=None) -> dict[str, torch.Tensor]:
    """Every parameter (or its grad) of the whole model as full global tensors (collective over the mesh).

    A ZeRO optimizer holds the reduced grad only for its dp range: its `reduced_grad` gathers it; its
    parameter all-gather may still be in flight (overlap_param_gather): pass it to wait for that."""
    import torch.distributed as dist

    if optimizer is not None:
        optimizer.sync_params()

    def grad(p):
        return optimizer.reduced_grad(p) if hasattr(optimizer, "reduced_grad") else p.grad

    mine = {
        n: gather_full(
            grad(p) if grads else p.data,
            p.placement.shard,
            mesh.ep if p.placement.expert else mesh.tp,
            mesh.etp if p.placement.expert else None,
        )
        for n, p in model.named_parameters()
        if not p.placement.pp_duplicate
    }
    if mesh.pp.size == 1:
        return mine
    parts = [None] * mesh.world
    dist.all_gather_object(parts, mine if mesh.tp.rank == 0 and mesh.dp.rank == 0 else {}, group=mesh.group)
    return {k: v for part in parts for k, v in part.items()}


def rank_batches(data, step: int, cfg, mesh) -> list:
    """This rank's micro-batches of optimizer step `step` (from 1): its dp slice, its cp chunks."""
    t = cfg.train
    return microbatches(
        data,
        step - 1,
        t.global_batch_size,
        t.micro_batch_size,
        mesh.dp.rank,
        mesh.dp.size,
        t.seed,
        cp_rank=mesh.cp.rank,
        cp_size=mesh.cp.size,
    )


def train_and_report(
    mesh,
    overrides: list[str],
    steps: int,
    setup=None,
    seed_dropout: bool = False,
    base: list[str] | None = None,
) -> dict | None:
    """Run `steps` optimizer steps; rank 0 returns losses, step-1 grads, final weights (full tensors).
    `setup(model)`, a module-level function, may change the fresh model first (same on every rank).
    `seed_dropout`: seed the dropout RNG before each step as the trainer does (layers.rng.seed_step), so
    two runs with dropout draw the same masks whatever the pool's processes ran before. `base`: the
    options under the overrides (TINY when None)."""
    from megaframe.layers.rng import seed_step

    cfg = job_config(mesh, overrides + [f"train.max_steps={steps}"], base)
    model = build_model(cfg, mesh)
    if setup is not None:
        setup(model)
    optimizer = build_optimizer(model, cfg.optim, mesh)
    data = build_data(cfg)
    if cfg.data.document_mask:
        model.set_documents(data.eos_ids)
    t = cfg.train
    losses, grads, comm_tp, norms = [], None, [], []
    for step in range(1, steps + 1):
        batches = rank_batches(data, step, cfg, mesh)
        mesh.stats.pop()
        if seed_dropout:
            seed_step(t.seed, step, mesh)
        res = train_step(model, optimizer, batches, mesh, cfg, step)
        comm_tp.append(dict(mesh.stats.pop()))
        loss = comm.all_reduce(res.loss_sum.clone(), mesh.dpcp) / (t.global_batch_size * cfg.model.seq_length)
        comm.all_reduce(loss, mesh.pp)  # only the last stage has a loss; the others add 0
        losses.append(loss.item())
        norms.append(res.grad_norm.item())
        if step == 1:
            grads = full_state(model, mesh, grads=True, optimizer=optimizer)
    weights = full_state(model, mesh, optimizer=optimizer)
    moe = moe_stats.metrics(model, mesh)  # the last step's router figures (collective; {} for a dense model)
    if mesh.rank != 0:
        return None
    return {"losses": losses, "grads": grads, "weights": weights, "comm": comm_tp, "moe": moe, "norms": norms}


def vocab_layers(mesh, sp: bool) -> dict | None:
    """Tied vocab-parallel embedding -> logits -> cross-entropy vs dense torch ops: rank 0 returns max
    errors."""
    import torch.nn.functional as F

    from megaframe.layers.shard import full_init
    from megaframe.layers.vocab import VocabParallelEmbedding, parallel_logits, vocab_parallel_cross_entropy

    v, d, s, b, tp = 64, 16, 8, 3, mesh.tp
    full_w = full_init("embed.weight", (v, d), 7, 0.5, 1)
    ids_SB = torch.randint(0, v, (s, b), generator=torch.Generator().manual_seed(1))
    target_SB = ids_SB.roll(1, 0)
    emb = VocabParallelEmbedding(v, d, tp, sp)
    emb.weight.data.copy_(emb.weight.placement.shard.local(full_w))
    loss_SB = vocab_parallel_cross_entropy(parallel_logits(emb(ids_SB), emb.weight, tp, sp), target_SB, tp)
    loss_SB.sum().backward()
    w_ref = full_w.clone().requires_grad_(True)
    ref_SB = F.cross_entropy(
        (F.embedding(ids_SB, w_ref) @ w_ref.t()).flatten(0, 1), target_SB.flatten(), reduction="none"
    ).view(s, b)
    ref_SB.sum().backward()
    errs = {
        "loss": (loss_SB - ref_SB).abs().max().item(),
        "grad": (emb.weight.grad - emb.weight.placement.shard.local(w_ref.grad)).abs().max().item(),
    }
    return errs if mesh.rank == 0 else None


def comm_volume(mesh, overrides: list[str]) -> dict | None:
    """Bytes sent per group during one training step of the tiny model; rank 0 returns them."""
    out = train_and_report(mesh, overrides, 1)
    return out and out["comm"][0]
