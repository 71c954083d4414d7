"""DeepSeek-V3's block: MLA (mla.py), then a dense SwiGLU MLP in the first model.moe_dense_layers blocks
and a DeepSeekMoE in the rest, each behind its RMSNorm pre-norm.

DeepSeekMoE: the routed experts (model/moe: sigmoid scores, the aux-loss-free bias, group-limited top-k,
the routed scaling factor, its dispatch over ep) plus shared experts, one dense SwiGLU of width
moe_shared_experts x moe_ffn_hidden_size that every token passes, split over tp like a dense MLP.

Names (global layer i): layers.{i}.attn_norm / attn.* (mla.py) / mlp_norm, layers.{i}.mlp.up_proj /
down_proj (dense), or layers.{i}.mlp.router / experts.* / shared.up_proj / shared.down_proj.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megaframe.config.schema import ModelConfig
from megaframe.layers.norm import Norm
from megaframe.layers.rng import tp_distinct
from megaframe.model.block import MLP, BlockArgs
from megaframe.model.kv_cache import LayerKV
from megaframe.model.moe import MoE
from megaframe.models.deepseek_v3.mla import MLA
from megaframe.parallel.mesh import Mesh


class DeepSeekMoE(MoE):
    """The routed experts (MoE) plus the shared experts' dense SwiGLU on the same input."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, sp: bool, device=None, tokens_per_step=None):
        super().__init__(cfg, mesh, sp, device, tokens_per_step)
        self.shared = None
        if cfg.moe_shared_experts:
            wide = dataclasses.replace(cfg, ffn_hidden_size=cfg.moe_shared_experts * cfg.expert_ffn)
            self.shared = MLP(wide, mesh, sp, device)

    def forward(self, x_SBD: torch.Tensor) -> torch.Tensor:
        y_SBD = super().forward(x_SBD)
        return y_SBD if self.shared is None else y_SBD + self.shared(x_SBD)


class DeepSeekBlock(nn.Module):
    """Pre-norm MLA and MLP (dense or DeepSeekMoE) with residuals."""

    def __init__(self, args: BlockArgs, layer: int):
        super().__init__()
        cfg, mesh, sp, dev = args.cfg, args.mesh, args.sp, args.device
        self.attn_norm = Norm("rmsnorm", cfg.hidden_size, cfg.norm_eps, sp, dev)
        selective = args.recompute == "selective"
        self.attn = MLA(cfg, mesh.tp, sp, dev, recompute_core=selective, cp=mesh.cp, cp_ring=args.cp_ring)
        self.mlp_norm = Norm("rmsnorm", cfg.hidden_size, cfg.norm_eps, sp, dev)
        if layer < cfg.moe_dense_layers or not cfg.num_experts:
            self.mlp = MLP(cfg, mesh, sp, dev)
        else:
            self.mlp = DeepSeekMoE(cfg, mesh, sp, dev, args.tokens_per_step)
        self.dropout = nn.Dropout(cfg.dropout)
        self.tp, self.sp = mesh.tp, sp

    def forward(self, x_SBD: torch.Tensor, rope, kv: LayerKV | None = None) -> torch.Tensor:
        # under sp each tp rank's residual stream is its own sequence block: distinct dropout masks
        if self.sp and self.tp.size > 1 and self.training and self.dropout.p > 0:
            with tp_distinct(self.tp, x_SBD.device):
                return self._forward(x_SBD, rope, kv)
        return self._forward(x_SBD, rope, kv)

    def _forward(self, x_SBD: torch.Tensor, rope, kv: LayerKV | None) -> torch.Tensor:
        x_SBD = x_SBD + self.dropout(self.attn(self.attn_norm(x_SBD), rope, kv))
        return x_SBD + self.dropout(self.mlp(self.mlp_norm(x_SBD)))


def build_block(args: BlockArgs, layer: int) -> DeepSeekBlock:
    return DeepSeekBlock(args, layer)
