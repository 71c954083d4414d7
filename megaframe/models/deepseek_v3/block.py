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

from megaframe.config.schema import ModelConfig
from megaframe.model.block import MLP, Block, BlockArgs
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


class DeepSeekBlock(Block):
    """The shared block's wiring (model/block.py: pre-norms, residuals, dropout) around MLA and a dense MLP
    (the first model.moe_dense_layers blocks, or no experts) or DeepSeekMoE (the family checks its norm:
    RMSNorm)."""

    def __init__(self, args: BlockArgs, layer: int):
        cfg, mesh, sp, dev = args.cfg, args.mesh, args.sp, args.device
        if layer < cfg.moe_dense_layers or not cfg.num_experts:
            mlp = MLP(cfg, mesh, sp, dev)
        else:
            mlp = DeepSeekMoE(cfg, mesh, sp, dev, args.tokens_per_step)
        super().__init__(
            cfg, mesh, sp, dev, args.tokens_per_step, args.recompute, args.cp_ring, attention=MLA, mlp=mlp
        )


def build_block(args: BlockArgs, layer: int) -> DeepSeekBlock:
    return DeepSeekBlock(args, layer)
