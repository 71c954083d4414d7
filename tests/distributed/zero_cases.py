"""Functions the rank pool runs for the ZeRO-1 tests: fn(mesh, *args), module-level for spawned workers."""

from __future__ import annotations

import math

import torch

from megaframe.checkpoint import sharded
from megaframe.optim.build import build_optimizer
from megaframe.parallel import comm
from megaframe.training.metrics import memory_figures
from tests.distributed.cases import full_state, job_config, rank_batches
from tests.forms import build_data, build_model, microbatches, train_step


def _setup(mesh, overrides: list[str], steps: int):
    cfg = job_config(mesh, overrides + [f"train.max_steps={steps}"])
    model = build_model(cfg, mesh)
    return cfg, model, build_optimizer(model, cfg.optim, mesh), build_data(cfg)


def _step(mesh, cfg, model, optimizer, data, step: int) -> tuple[float, dict]:
    """One optimizer step; returns the global mean loss and the bytes sent per group during the step."""
    t = cfg.train
    batches = rank_batches(data, step, cfg, mesh)
    mesh.stats.pop()
    res = train_step(model, optimizer, batches, mesh, cfg, step)
    sent = dict(mesh.stats.pop())
    loss = comm.all_reduce(res.loss_sum.clone(), mesh.dpcp) / (t.global_batch_size * cfg.model.seq_length)
    comm.all_reduce(loss, mesh.pp)  # only the last pipeline stage has a loss
    return loss.item(), sent


def run_steps(
    mesh,
    overrides: list[str],
    steps: int,
    load: str | None = None,
    save: str | None = None,
    start: int = 0,
    stop: int | None = None,
) -> dict | None:
    """Steps start+1..stop of a `steps`-step run (after loading checkpoint `load`), saving at the end
    when `save` names a folder.

    Rank 0 returns losses, the step-1 reduced grads (full tensors), final weights, per-step bytes by
    group, memory figures and the padded buffer size."""
    cfg, model, optimizer, data = _setup(mesh, overrides, steps)
    if load:
        sharded.load_into(load, model, optimizer)
    losses, sent, grads = [], [], None
    stop = stop or steps
    for step in range(start + 1, stop + 1):
        loss, s = _step(mesh, cfg, model, optimizer, data, step)
        losses.append(loss)
        sent.append(s)
        if step == 1:
            grads = full_state(model, mesh, grads=True, optimizer=optimizer)
    weights = full_state(model, mesh, optimizer=optimizer)
    if save:
        # the rule's name, as the trainer records it: a load reads the optimizer state of its own rule only
        meta = {"layout": {"dp": mesh.dp.size}, "config": {"optim": {"name": cfg.optim.name}}}
        sharded.save(save, stop, model, optimizer, mesh, meta)
    mem = memory_figures(model, optimizer, mesh.device)
    every = comm.gather_objects(mem["mem/params_bytes"], mesh.group)  # every rank's, for the share
    optim_every = comm.gather_objects(mem["mem/optim_bytes"], mesh.group)
    if mesh.rank != 0:
        return None
    buffers = getattr(optimizer, "buffers", [])
    return {
        "losses": losses,
        "grads": grads,
        "weights": weights,
        "comm": sent,
        "mem": mem,
        "params_bytes_per_rank": every,
        "optim_bytes_per_rank": optim_every,
        "bucket_uses": bucket_uses(optimizer),
        "buffer_numel": sum(b.numel for b in buffers),
        "buckets": sum(len(b.buckets) for b in buffers),
        "bucket_numels": [b.numel for buf in buffers for b in buf.buckets],
        "bucket_late": [b.late for buf in buffers for b in buf.buckets],
        "microbatches": cfg.train.global_batch_size // (cfg.train.micro_batch_size * mesh.dp.size),
        "params_numel": sum(p.numel() for p in model.parameters()),
    }


def bucket_uses(optimizer) -> list[list[bool]]:
    """zero=3: per bucket (buffer order), whether each gather unit reading it reads it in backward too
    (empty: a bucket no unit reads, kept gathered)."""
    units = getattr(optimizer, "units", None)
    if units is None:
        return []
    return [
        [units[i][2] for i, held in enumerate(optimizer.block_buckets) if any(x is b for _, x in held)]
        for buf in optimizer.buffers
        for b in buf.buckets
    ]


def logical_moments(mesh, overrides: list[str], steps: int) -> dict | None:
    """After `steps` steps: every parameter's Adam moments as logical (full, global) tensors."""
    from megaframe.layers.shard import gather_full

    cfg, model, optimizer, data = _setup(mesh, overrides, steps)
    for step in range(1, steps + 1):
        _step(mesh, cfg, model, optimizer, data, step)
    out = {}
    for name, p in model.named_parameters():
        for k, t in optimizer.logical_state(p).items():
            out[f"{k}/{name}"] = gather_full(t, p.placement.shard, mesh.tp)
    return out if mesh.rank == 0 else None


def overlap_probe(mesh, overrides: list[str], overlap: bool) -> dict | None:
    """Which buckets have their reduce-scatter launched before step(): after a non-last micro-batch's
    backward, and after the last one (the hooks only act inside backward_context(is_last=True))."""
    from megaframe.optim.zero import ZeroOptimizer

    cfg, model, _, data = _setup(mesh, overrides, 1)
    optimizer = ZeroOptimizer(model, cfg.optim, mesh, overlap=overlap)
    t = cfg.train
    batches = microbatches(
        data, 0, t.global_batch_size, t.micro_batch_size, mesh.dp.rank, mesh.dp.size, t.seed
    )
    optimizer.zero_grad()
    launched = []
    tokens = t.global_batch_size * cfg.model.seq_length
    for i, (ids, labels) in enumerate(batches):
        loss = model(ids, labels).float().sum() / tokens
        with optimizer.backward_context(is_last=i == len(batches) - 1):
            loss.backward()
        launched.append([b.launched for buf in optimizer.buffers for b in buf.buckets])
    optimizer.step(1e-3)
    return {"launched": launched} if mesh.rank == 0 else None


def bf16_losses(mesh, overrides: list[str], steps: int) -> dict | None:
    """Train in bf16; rank 0 returns the losses, the param dtype and the optimizer's state dtypes."""
    cfg, model, optimizer, data = _setup(mesh, overrides + ["train.precision=bf16"], steps)
    losses = [_step(mesh, cfg, model, optimizer, data, s)[0] for s in range(1, steps + 1)]
    p = next(model.parameters())
    state = optimizer.logical_state(p)
    if mesh.rank != 0:
        return None
    return {
        "losses": losses,
        "param_dtype": str(p.dtype),
        "state_dtypes": {k: str(v.dtype) for k, v in state.items()},
        "finite": all(math.isfinite(x) for x in losses),
        "mem": memory_figures(model, optimizer, mesh.device),
    }


def bf16_checkpoint_roundtrip(mesh, load_overrides: list[str], folder: str) -> dict | None:
    """bf16 zero=1: two steps, save; load into an fp32 run (`load_overrides`); rank 0 returns the largest
    difference between a loaded weight and the saved fp32 master."""
    run_steps(mesh, ["train.precision=bf16"], 2, save=folder)
    cfg, model, optimizer, _ = _setup(mesh, load_overrides, 2)
    path = sharded.latest(folder)
    sharded.load_into(path, model, optimizer)
    meta = sharded.read_metadata(path)
    name, p = next((n, q) for n, q in model.named_parameters() if q.ndim >= 2)
    master = sharded.load_full(path, f"optim/master/{name}", meta)
    return (
        {
            "err": (p.detach().float() - p.placement.shard.local(master)).abs().max().item(),
            "has_master": f"optim/master/{name}" in meta["tensors"],
        }
        if mesh.rank == 0
        else None
    )


def pipeline_ends_probe(mesh, overrides: list[str]) -> dict:
    """One step; every rank returns its pipeline rank, the bytes it sent per group, which of its ZeRO
    buckets had their reduce-scatter launched before step() (empty for zero=0), and (rank 0) the
    reduced step-1 grads as full tensors."""
    cfg, model, optimizer, data = _setup(mesh, overrides, 1)
    launched: list[bool] = []
    if hasattr(optimizer, "buffers"):
        step = optimizer.step

        def probed_step(lr):
            launched.extend(b.launched for buf in optimizer.buffers for b in buf.buckets)
            return step(lr)

        optimizer.step = probed_step
    loss, sent = _step(mesh, cfg, model, optimizer, data, 1)
    grads = full_state(model, mesh, grads=True, optimizer=optimizer)
    return {
        "pp_rank": mesh.pp.rank,
        "sent": sent,
        "launched": launched,
        "loss": loss,
        "grads": grads if mesh.rank == 0 else None,
    }


def param_gather_probe(mesh, overrides: list[str]) -> dict | None:
    """One step, then the next forward: param all-gathers not yet waited for right after step(), at the
    entry of the first transformer block (after the optimizer's own pre-hook there) and after the forward."""
    cfg, model, optimizer, data = _setup(mesh, overrides, 2)
    _step(mesh, cfg, model, optimizer, data, 1)
    seen = {"after_step": optimizer.param_gather.in_flight, "total": len(optimizer.param_gather.works)}

    def probe(module, args):
        seen.setdefault("first_block", optimizer.param_gather.in_flight)

    model.layers["0"].register_forward_pre_hook(probe)
    t = cfg.train
    ids, labels = microbatches(
        data, 1, t.global_batch_size, t.micro_batch_size, mesh.dp.rank, mesh.dp.size, t.seed
    )[0]
    with torch.no_grad():
        model(ids, labels)
    seen["after_forward"] = optimizer.param_gather.in_flight
    return seen if mesh.rank == 0 else None


def save_gather_probe(mesh, overrides: list[str], folder: str) -> dict | None:
    """zero=3: two steps, then a save as the trainer makes it (settle, then save). Rank 0 returns the most
    param bytes gathered at once in the steps and in the save, and the bytes sent on dp by the save."""
    cfg, model, optimizer, data = _setup(mesh, overrides, 2)
    for step in (1, 2):
        _step(mesh, cfg, model, optimizer, data, step)
    in_steps, optimizer.gathered_high = optimizer.gathered_high, 0
    mesh.stats.pop()
    optimizer.settle()
    sharded.save(folder, 2, model, optimizer, mesh, {"layout": {"dp": mesh.dp.size}})
    sent, saved = dict(mesh.stats.pop()), optimizer.gathered_high
    weights = full_state(model, mesh, optimizer=optimizer)  # collective: every rank
    return (
        {"steps": in_steps, "save": saved, "save_dp_bytes": sent.get("dp", 0), "weights": weights}
        if mesh.rank == 0
        else None
    )


def run_steps_counting_graphs(mesh, overrides: list[str], steps: int) -> dict | None:
    """run_steps, with dynamo's counters of this run on rank 0's result: unique graphs, graph breaks,
    recompiles."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    out = run_steps(mesh, overrides, steps)
    if out is not None:
        out["graphs"] = counters["stats"]["unique_graphs"]
        out["breaks"] = dict(counters["graph_break"])
        out["recompiles"] = dict(counters["recompiles"])
    return out
