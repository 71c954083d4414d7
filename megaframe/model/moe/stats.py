"""Per-step MoE statistics: the figures that make load imbalance visible, and the expert-bias update.

Each MoE layer accumulates, over the step's micro-batches and on the device, a row
    [routed assignments per expert (E) | dropped, assigned, entropy sum, tokens, aux, z]
of this rank's tokens (see layer.STAT_NAMES). Summed over cp·dp (each cp rank routed its own chunks)
— and over tp under sp, where each tp rank routed its own sequence block (without sp every tp rank
routed the same tokens) — the row describes the whole global batch. Each layer lives on one pipeline
stage: a sum over pp of the [layers, E + 6] table (zero rows for other stages' layers) brings all of
them to the logging rank.
Nothing here syncs the host except `metrics`, which the trainer calls at log steps only.
"""

from __future__ import annotations

import torch

from megaframe.model.moe.layer import STAT_NAMES, MoE
from megaframe.parallel import comm
from megaframe.parallel.mesh import Mesh

IMBALANCE_WARN = 2.0
"""Warn when an expert gets more than this many times the mean load of a layer (or none at all)."""


def moe_layers(model) -> list[tuple[int, MoE]]:
    """(global layer index, MoE) for this rank's MoE layers, wherever the family's block holds them; an MTP
    depth k's block is global layer num_layers + k (DeepSeek's numbering), so its loads are logged and its
    expert bias moves like every other layer's."""
    blocks = [(int(i), block) for i, block in model.layers.items()]
    if getattr(model, "mtp", None) is not None:
        blocks += [(model.cfg.num_layers + int(k), depth.block) for k, depth in model.mtp.items()]
    return [(i, m) for i, block in blocks for m in block.modules() if isinstance(m, MoE)]


def table_rows(cfg) -> int:
    """Rows of the statistics table: the trunk's layers, then the MTP depths'."""
    return cfg.num_layers + cfg.mtp_num_layers


def begin_step(model) -> None:
    for _, layer in moe_layers(model):
        layer.step_stats.zero_()


def reduced_table(model, mesh: Mesh, over_pp: bool) -> torch.Tensor | None:
    """[table_rows, E + 6] step statistics of the global batch (collective over cp·dp, tp, and pp when
    `over_pp`); None for a dense model."""
    cfg = model.cfg
    if cfg.num_experts == 0:
        return None
    # fp64: token counts summed over a large global batch and many steps must stay exact integers.
    # Every rank builds the full [table_rows, ...] table, zero rows included, so the shapes agree.
    table = torch.zeros(
        table_rows(cfg), cfg.num_experts + len(STAT_NAMES), dtype=torch.float64, device=mesh.device
    )
    for i, layer in moe_layers(model):
        table[i] = layer.step_stats
    # Fixed order cp·dp, tp, pp on every rank; the `if`s depend only on config, so all ranks take them alike.
    comm.all_reduce(table, mesh.dpcp)
    if model.sp:
        comm.all_reduce(table, mesh.tp)
    if over_pp:
        comm.all_reduce(table, mesh.pp)
    return table


@torch.no_grad()
def update_expert_bias(model, mesh: Mesh) -> None:
    """Aux-loss-free balancing (DeepSeek-V3), after each optimizer step: bias_e += rate · sign(mean load
    - load_e) from the global batch's routed counts, then recentred to zero mean. Every rank computes the
    same update from the same all-reduced counts, so the replicated buffer stays equal everywhere."""
    cfg = model.cfg
    if cfg.num_experts == 0 or not cfg.moe_expert_bias:
        return
    # No pp reduction: each stage updates only its own layers' biases, from rows its own ranks summed.
    table = reduced_table(model, mesh, over_pp=False)
    for i, layer in moe_layers(model):
        counts_E = table[i, : cfg.num_experts]
        bias_E = layer.router.expert_bias
        bias_E += (cfg.moe_bias_update_rate * torch.sign(counts_E.mean() - counts_E)).to(bias_E.dtype)
        # Recentred: only differences between experts matter for top-k, and this stops a common drift.
        bias_E -= bias_E.mean()


def metrics(model, mesh: Mesh) -> dict[str, float]:
    """aux_loss, z_loss and per-layer load figures of this step (collective; one host sync)."""
    table = reduced_table(model, mesh, over_pp=True)
    if table is None:
        return {}
    e = model.cfg.num_experts
    col = {name: e + j for j, name in enumerate(STAT_NAMES)}
    # The one host sync, at log steps only: the figures go to the logger as Python floats.
    rows = table.tolist()
    out = {"aux_loss": sum(r[col["aux"]] for r in rows), "z_loss": sum(r[col["z"]] for r in rows)}
    for i, r in enumerate(rows):
        counts = torch.tensor(r[:e], dtype=torch.float64)
        mean = counts.mean().item()
        out[f"moe/layer{i}/tokens_min"] = counts.min().item()
        out[f"moe/layer{i}/tokens_max"] = counts.max().item()
        out[f"moe/layer{i}/tokens_mean"] = mean
        out[f"moe/layer{i}/tokens_cv"] = counts.std(unbiased=False).item() / mean if mean > 0 else 0.0
        out[f"moe/layer{i}/dropped_frac"] = r[col["dropped"]] / max(r[col["assigned"]], 1.0)
        out[f"moe/layer{i}/router_entropy"] = r[col["entropy_sum"]] / max(r[col["tokens"]], 1.0)
    return out


def imbalance_warnings(row: dict, num_layers: int) -> list[str]:
    """One line per layer whose busiest expert has > IMBALANCE_WARN x the mean load, or an idle expert."""
    out = []
    for i in range(num_layers):
        lo, hi, mean, cv = (row.get(f"moe/layer{i}/tokens_{k}") for k in ("min", "max", "mean", "cv"))
        if mean and (hi > IMBALANCE_WARN * mean or lo == 0):
            out.append(
                f"megaframe: warning: step {row['step']} moe layer {i}: expert load imbalanced "
                f"(tokens per expert min {lo:.0f}, max {hi:.0f} = {hi / mean:.1f}x the mean, cv {cv:.2f})"
            )
    return out
