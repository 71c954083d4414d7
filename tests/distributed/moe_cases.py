"""Functions the rank pool runs for the MoE tests: fn(mesh, *args), module-level for spawned workers.

Legend: T tokens per rank, D hidden, E experts.
"""

from __future__ import annotations

import torch

from megaframe.layers.shard import init_model
from megaframe.model.moe.layer import MoE
from megaframe.parallel.mesh import single_process_mesh
from tests.distributed.cases import tiny_config

MOE = [
    "model.family=mixtral",
    "model.num_experts=4",
    "model.moe_top_k=2",
    "model.moe_ffn_hidden_size=64",
    "model.moe_z_loss_coeff=1e-3",
]


def _layer(cfg, mesh, seed: int = 5) -> MoE:
    layer = MoE(cfg.model, mesh, sp=False, device=torch.device("cpu"), tokens_per_step=None)
    # init under the names the layer has inside a model, so every ep slices the same global experts
    named = torch.nn.ModuleDict({"mlp": layer})
    init_model(named, seed, 0.5, 1)
    return layer


def _tokens(rank: int, t: int, d: int) -> torch.Tensor:
    return torch.randn(t, 1, d, generator=torch.Generator().manual_seed(100 + rank))


def _run(layer: MoE, x_TBD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Forward, backward of a fixed projection of the output; (y, x grad, param grads by name)."""
    x = x_TBD.clone().requires_grad_(True)
    y = layer(x)
    proj = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))
    (y * proj).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def dispatcher_vs_one_process(mesh, overrides: list[str]) -> dict | None:
    """Each rank routes its own tokens through the ep-split layer; rank 0 also runs one process's layer
    on every rank's tokens in turn (grads summed) and returns the largest differences."""
    import torch.distributed as dist

    from megaframe.layers.shard import gather_full

    cfg = tiny_config(MOE + overrides, mesh.world)
    d, t = cfg.model.hidden_size, 24
    mesh.stats.pop()
    y, gx, grads = _run(_layer(cfg, mesh), _tokens(mesh.rank, t, d))
    layer = _layer(cfg, mesh)
    bytes_vs_theory = _ep_bytes_vs_theory if mesh.ep_rail is None else _rail_bytes_vs_theory
    sent = bytes_vs_theory(cfg, mesh, layer, _tokens(mesh.rank, t, d))
    full = {
        n: gather_full(g, p.placement.shard, mesh.ep if p.placement.expert else mesh.tp)
        for (n, p), g in zip(layer.named_parameters(), grads.values())
    }
    for n, p in layer.named_parameters():  # the router is replicated: its grads add up over the ranks
        if not p.placement.expert:
            dist.all_reduce(full[n], group=mesh.group)
    ys = [torch.empty_like(y) for _ in range(mesh.world)]
    gxs = [torch.empty_like(gx) for _ in range(mesh.world)]
    dist.all_gather(ys, y, group=mesh.group)
    dist.all_gather(gxs, gx, group=mesh.group)
    if mesh.rank != 0:
        return None
    ref_layer = _layer(cfg, single_process_mesh())
    errs = {"y": 0.0, "x_grad": 0.0}
    ref_grads = {n: torch.zeros_like(p) for n, p in ref_layer.named_parameters()}
    for r in range(mesh.world):
        ref_layer.zero_grad()
        ry, rgx, rg = _run(ref_layer, _tokens(r, t, d))
        errs["y"] = max(errs["y"], (ry - ys[r]).abs().max().item())
        errs["x_grad"] = max(errs["x_grad"], (rgx - gxs[r]).abs().max().item())
        for n in rg:
            ref_grads[n] += rg[n]
    for n, g in ref_grads.items():
        errs[n] = (g - full[n]).abs().max().item()
    errs["scale"] = max(g.abs().max().item() for g in ref_grads.values())
    return {**errs, **sent}


def _ep_bytes_vs_theory(cfg, mesh, layer: MoE, x_TBD: torch.Tensor) -> dict:
    """(counted, expected) ep bytes summed over ranks for one forward + backward. A row (D fp32) that
    leaves its rank crosses ep four times: dispatch and combine forward, both again in backward; the
    rows a rank receives are other ranks' departures, so over all ranks it is 4 x the rows sent off-rank.
    Its combine weight (fp32) goes with it, and its grad comes back: twice. Plus one even all-to-all of E
    int64 counts per rank."""
    import torch.distributed as dist

    counted = mesh.stats.pop().get("ep", 0)
    e, ep = cfg.model.num_experts, mesh.ep.size
    with torch.no_grad():
        experts = torch.topk(layer.router(x_TBD.reshape(-1, x_TBD.shape[-1])), cfg.model.moe_top_k).indices
    off_rank = (experts // (e // ep) != mesh.ep.rank).sum().item()
    expected = 4 * off_rank * x_TBD.shape[-1] * 4 + 2 * off_rank * 4 + int((ep - 1) / ep * e * 8)
    both = torch.tensor([counted, expected], dtype=torch.float64)
    dist.all_reduce(both, group=mesh.group)
    return {"ep_bytes": both[0].item(), "ep_bytes_theory": both[1].item()}


def _rail_bytes_vs_theory(cfg, mesh, layer: MoE, x_TBD: torch.Tensor) -> dict:
    """Under parallel.ep_dispatch=node: (counted, expected) bytes between nodes (over ep_rail, counted on
    an axis of its own) summed over ranks for one forward + backward, and what the plain dispatcher would
    send between nodes. A (token, other node) pair crosses four times (rows there and back, forward and
    backward), its K expert ids (int32) once and its K weights twice; plus the N int64 counts. The plain
    dispatcher sends a row per (token, expert on another node), four times."""
    import dataclasses

    import torch.distributed as dist

    from megaframe.parallel.flight import CommStats

    rail = dataclasses.replace(mesh.ep_rail, stats=CommStats())
    layer.by_node = (rail, mesh.ep_node)
    _run(layer, x_TBD)
    counted = rail.stats.sent.get("ep", 0)
    e, k, n, d = cfg.model.num_experts, cfg.model.moe_top_k, rail.size, x_TBD.shape[-1]
    with torch.no_grad():
        experts = torch.topk(layer.router(x_TBD.reshape(-1, d)), k).indices
    node_TK = experts // (e // n)
    hit_TN = torch.zeros(node_TK.shape[0], n, dtype=torch.bool).scatter_(1, node_TK, True)
    pairs = hit_TN.sum().item() - hit_TN[:, rail.rank].sum().item()
    plain = (node_TK != rail.rank).sum().item()
    expected = 4 * pairs * d * 4 + pairs * k * 4 + 2 * pairs * k * 4 + (n - 1) * 8
    got = torch.tensor([counted, expected, 4 * pairs * d * 4, 4 * plain * d * 4], dtype=torch.float64)
    dist.all_reduce(got, group=mesh.group)
    names = ("ep_bytes", "ep_bytes_theory", "node_row_bytes", "plain_node_row_bytes")
    return {name: v.item() for name, v in zip(names, got)}


def checkpoint_across_ep(mesh, overrides: list[str], folder: str, steps: int, save_at: int) -> dict | None:
    """Steps 1..save_at then a checkpoint under this mesh (`folder` empty), or, if it holds one, load
    it and run save_at+1..steps. Rank 0 returns losses and final weights."""
    from megaframe.checkpoint import sharded
    from tests.distributed.zero_cases import run_steps

    latest = sharded.latest(folder)
    if latest is None:
        return run_steps(mesh, overrides, steps, save=folder, stop=save_at)
    return run_steps(mesh, overrides, steps, load=str(latest), start=save_at)


@torch.no_grad()
def starve_experts(model) -> None:
    """Force imbalance: a large fixed expert bias sends every token to experts 0 and 1 (of 4), so the
    other experts (all of ep rank 1's under ep2) get no tokens and only zero grads."""
    from megaframe.model.moe import stats

    for _, layer in stats.moe_layers(model):
        layer.router.expert_bias.copy_(torch.tensor([10.0, 9.0, 0.0, 0.0]))
