"""The shared transformer block (Llama, Qwen3, GPT-2 and Mixtral build it; models/<family>/spec.py names
its builder) and what every family's block builder receives.

A block builder is `(BlockArgs, i) -> module` for global layer i (so a family may build its first layers
dense, or layers of two kinds); the module's forward is `(x_SBD, rope, kv=None) -> x_SBD`: hidden states in
and out, `rope` the stage's (cos, sin[, DocContext]) tables, `kv` this layer's decoding cache
(model/kv_cache.py) or None in training. The stage shell (model/gpt.py) knows nothing more of a block.

Legend: S sequence (S/tp under sp), B batch, D hidden, F ffn on this rank (F/tp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megaframe.config.schema import ModelConfig
from megaframe.layers.linear import ColumnParallelLinear, RowParallelLinear
from megaframe.layers.norm import Norm
from megaframe.layers.rng import tp_distinct
from megaframe.model.attention import Attention
from megaframe.model.kv_cache import LayerKV
from megaframe.model.moe import MoE
from megaframe.parallel.mesh import Mesh


@dataclass(frozen=True)
class BlockArgs:
    """What a family's block builder gets, the same for every layer of a stage."""

    cfg: ModelConfig
    mesh: Mesh
    sp: bool
    """Sequence parallel (already False at tp = 1)."""
    device: torch.device | str | None
    """Where the parameters go (meta while the builder places and slices them)."""
    tokens_per_step: int | None
    """Global batch x seq: MoE router losses scale like the LM loss (moe/layer.py)."""
    recompute: str
    """train.recompute: selective recomputes the attention core."""
    cp_ring: bool
    """parallel.cp_comm=ring: attention passes K/V around the cp ring."""


def build_block(args: BlockArgs, i: int) -> "Block":
    """The shared block, every layer alike."""
    return Block(
        args.cfg, args.mesh, args.sp, args.device, args.tokens_per_step, args.recompute, args.cp_ring
    )


class MLP(nn.Module):
    """SwiGLU: down(silu(gate) * up) with fused [gate | up]; or GELU: down(gelu(up))."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, sp: bool, device=None):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        f = cfg.ffn_hidden_size
        parts = [f, f] if self.swiglu else [f]
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, parts, mesh.tp, sp, cfg.bias, device)
        self.down_proj = RowParallelLinear(f, cfg.hidden_size, mesh.tp, sp, cfg.bias, device)

    def forward(self, x_SBD: torch.Tensor) -> torch.Tensor:
        h_SBX = self.up_proj(x_SBD)
        if self.swiglu:
            gate_SBF, up_SBF = h_SBX.chunk(2, dim=-1)
            h_SBF = F.silu(gate_SBF) * up_SBF
        else:
            # tanh form: HF GPT-2's gelu_new, so imported weights match
            h_SBF = F.gelu(h_SBX, approximate="tanh")
        return self.down_proj(h_SBF)


class Block(nn.Module):
    """Attention and MLP with pre-norms and residuals; the MLP a mixture of experts when num_experts > 0.

    A family whose attention or MLP differs keeps this wiring (norms, residuals, dropout, sp's distinct
    masks) and passes its own: `attention`, a class built like Attention (its kernels' settings: selective
    recompute, cp), and `mlp`, the built module (models/deepseek_v3/block.py)."""

    def __init__(
        self,
        cfg: ModelConfig,
        mesh: Mesh,
        sp: bool,
        device=None,
        tokens_per_step: int | None = None,
        recompute: str = "none",
        cp_ring: bool = False,
        attention: type[Attention] = Attention,
        mlp: nn.Module | None = None,
    ):
        super().__init__()
        self.attn_norm = Norm(cfg.norm, cfg.hidden_size, cfg.norm_eps, sp, device)
        self.attn = attention(
            cfg, mesh.tp, sp, device, recompute_core=recompute == "selective", cp=mesh.cp, cp_ring=cp_ring
        )
        self.mlp_norm = Norm(cfg.norm, cfg.hidden_size, cfg.norm_eps, sp, device)
        if mlp is not None:
            self.mlp = mlp
        elif cfg.num_experts:
            self.mlp = MoE(cfg, mesh, sp, device, tokens_per_step)
        else:
            self.mlp = MLP(cfg, mesh, sp, device)
        self.dropout = nn.Dropout(cfg.dropout)
        self.tp, self.sp = mesh.tp, sp

    def forward(self, x_SBD: torch.Tensor, rope, kv: LayerKV | None = None) -> torch.Tensor:
        # under sp each tp rank's residual stream is its own sequence block: distinct masks; without sp
        # it is a replica, whose masks must agree (layers.rng). No context at all without dropout, so
        # a compiled block traces nothing extra.
        if self.sp and self.tp.size > 1 and self.training and self.dropout.p > 0:
            with tp_distinct(self.tp, x_SBD.device):
                return self._forward(x_SBD, rope, kv)
        return self._forward(x_SBD, rope, kv)

    def _forward(self, x_SBD: torch.Tensor, rope, kv: LayerKV | None) -> torch.Tensor:
        x_SBD = x_SBD + self.dropout(self.attn(self.attn_norm(x_SBD), rope, kv))
        return x_SBD + self.dropout(self.mlp(self.mlp_norm(x_SBD)))
