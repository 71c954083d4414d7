"""Multi-token prediction (DeepSeek-V3, model.mtp_num_layers = M depths), on the last pipeline stage.

Depth k (1..M) predicts, at each position p, the token p+k+1: it combines the previous depth's hidden
state h (the main model's last block output for k = 1) with the embedding of token p+k,
    h_k = block_k(eh_proj([enorm(embed(token p+k)) | hnorm(h_{k-1})]))
and scores final_norm_k(h_k) with the shared head against token p+k+1 (positions past the sequence's end
count nothing). The embedding and the head are the model's own (the last stage keeps a copy of the
embedding, summed with stage 0's like a tied one: gpt.py), the block the family's builder's for global
layer num_layers + k - 1. Names: mtp.{k-1}.{enorm,hnorm,eh_proj,final_norm}.weight, mtp.{k-1}.block.*.

The objective adds mtp_loss_weight / M x the depths' summed token losses over the step's tokens, the LM
loss's divisor: the sum enters through `_InjectLoss` (moe/layer.py's), the identity on the LM loss whose
backward seeds it, so the pipeline executor and the logged `loss` stay the LM's. The logged `mtp_loss` is
the mean over the depths of their token-mean losses of the step (`metrics`). Generation (no labels) and
evaluation (no grad) skip the depths.

Labels under cp: each rank holds two chunks of every sequence, so the tokens ahead of its own are
gathered over cp (integers: no grad) and read at global positions (`positions`).

Legend: S this rank's sequence rows (S/tp under sp), B batch, D hidden, P positions of this cp rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megaframe.layers.norm import Norm
from megaframe.layers.shard import Shard, sharded_param
from megaframe.model.moe.layer import _InjectLoss
from megaframe.parallel import comm
from megaframe.parallel.mesh import Mesh


class Depth(nn.Module):
    """One MTP depth: enorm, hnorm, eh_proj [D, 2D] (replicated over tp, on this rank's rows), its block,
    final_norm."""

    def __init__(self, args, block, layer: int):
        super().__init__()
        cfg, sp, dev = args.cfg, args.sp, args.device
        d = cfg.hidden_size
        self.enorm = Norm(cfg.norm, d, cfg.norm_eps, sp, dev)
        self.hnorm = Norm(cfg.norm, d, cfg.norm_eps, sp, dev)
        self.eh_proj = nn.Module()
        self.eh_proj.weight = sharded_param(Shard((d, 2 * d)), dev, tp_partial_grad=sp)
        self.block = block(args, layer)
        self.final_norm = Norm(cfg.norm, d, cfg.norm_eps, sp, dev)

    def forward(self, h_SBD: torch.Tensor, e_SBD: torch.Tensor, rope) -> torch.Tensor:
        x_SBX = torch.cat([self.enorm(e_SBD), self.hnorm(h_SBD)], dim=-1)
        return self.block(F.linear(x_SBX, self.eh_proj.weight), rope)


def build(args, block) -> nn.ModuleDict:
    """The M depths (global layers num_layers .. num_layers + M - 1 to the family's builder)."""
    n = args.cfg.num_layers
    return nn.ModuleDict({str(k): Depth(args, block, n + k) for k in range(args.cfg.mtp_num_layers)})


def _global_labels(labels_BP: torch.Tensor, positions_P: torch.Tensor, mesh: Mesh, seq: int) -> torch.Tensor:
    """[B, seq] labels in sequence order: this rank's, or under cp every cp rank's put at its positions."""
    if mesh.cp.size == 1:
        return labels_BP
    all_CBP = comm.all_gather_dim0(labels_BP.unsqueeze(0).contiguous(), mesh.cp)
    pos_CP = comm.all_gather_dim0(positions_P.unsqueeze(0).contiguous(), mesh.cp)
    out_BS = labels_BP.new_zeros(labels_BP.shape[0], seq)
    out_BS[:, pos_CP.reshape(-1)] = all_CBP.permute(1, 0, 2).reshape(labels_BP.shape[0], -1)
    return out_BS


def losses(model, h_SBD: torch.Tensor, labels_BP: torch.Tensor, rope, score) -> torch.Tensor:
    """The depths' summed token losses (a scalar carrying their grad); `score(x_SBD, labels_BP)` is the
    model's head and loss per token [B, P]. Adds the step statistics."""
    seq = model.cfg.seq_length
    pos_P = model.positions
    full_BS = _global_labels(labels_BP, pos_P, model.mesh, seq)
    total, depths = h_SBD.new_zeros((), dtype=torch.float32), []
    for k, depth in enumerate(model.mtp.values(), start=1):
        ahead_P = pos_P + k  # the target's index in the labels (labels[p] is token p+1)
        valid_P = ahead_P < seq
        ids_BP = full_BS[:, (ahead_P - 1).clamp(max=seq - 1)].clamp_min(0)
        target_BP = full_BS[:, ahead_P.clamp(max=seq - 1)]
        h_SBD = depth(h_SBD, model.embed(ids_BP.t()), rope)
        loss_BP = score(depth.final_norm(h_SBD), target_BP) * valid_P
        total = total + loss_BP.float().sum()
        depths.append(
            torch.stack([loss_BP.detach().sum().double(), valid_P.sum().double() * loss_BP.shape[0]])
        )
    with torch.no_grad():
        model.mtp_stats += torch.stack(depths)
    return total


def attach(model, loss_BP: torch.Tensor, total: torch.Tensor, loss_scale: float | None) -> torch.Tensor:
    """loss_BP unchanged, its backward also seeding the depths' sum with weight / M x each token loss's
    upstream grad (the executor's loss_scale; else 1 / tokens_per_step, or the micro-batch's tokens)."""
    cfg = model.cfg
    per_token = loss_scale if loss_scale is not None else 1.0 / (model.tokens_per_step or loss_BP.numel())
    return _InjectLoss.apply(loss_BP, total, cfg.mtp_loss_weight / cfg.mtp_num_layers * per_token)


def begin_step(model) -> None:
    if getattr(model, "mtp", None) is not None:
        model.mtp_stats.zero_()


def metrics(model, mesh: Mesh) -> dict[str, float]:
    """mtp_loss of this step: the mean over the depths of each one's token-mean loss (collective over cp·dp
    and pp: every rank calls it; only the last stage holds the depths)."""
    m = model.cfg.mtp_num_layers
    if not m:
        return {}
    stats = model.mtp_stats.clone() if getattr(model, "mtp", None) is not None else None
    if stats is None:
        stats = torch.zeros((m, 2), dtype=torch.float64, device=mesh.device)
    comm.all_reduce(stats, mesh.dpcp)
    comm.all_reduce(stats, mesh.pp)
    rows = stats.tolist()
    return {"mtp_loss": sum(s / max(n, 1.0) for s, n in rows) / m}
