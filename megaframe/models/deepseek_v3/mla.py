"""Multi-head latent attention (DeepSeek-V2/V3), tensor-parallel over heads; the attention kernels (one
process, sp, cp ring and all-gather, document masks, selective recompute) are model/attention.py's.

Legend: S sequence (this rank's block under sp / cp), B batch, D hidden, H query heads on this rank
(heads/tp), N no-RoPE part (qk_nope_head_dim), R RoPE part (qk_rope_head_dim), Q = N + R the query/key
width, V value width (v_head_dim), Cq / Ckv the query / key-value latents (q_lora_rank, kv_lora_rank).

    q    = q_b_proj(q_norm(q_a_proj(x)))   [S, B, H, Q]   (q_proj(x) without q_lora_rank)
    c, r = kv_a_proj(x)                    [S, B, Ckv], [S, B, R]   (r: one RoPE key shared by the heads)
    k, v = kv_b_proj(kv_norm(c))           [S, B, H, N], [S, B, H, V]
    key  = [k | rope(r)], query = [q_nope | rope(q_rope)], out_proj over the H·V outputs.

The down projections (q_a_proj, kv_a_proj) are replicated over tp and run on this rank's tokens: their
latents enter the column-parallel up projections, which gather them over the sequence under sp (the
latent, not D, crosses the wire); under sp their grads are partial over tp (summed before the step), as
the norms'. The shared RoPE key meets only this rank's heads: it is gathered over sp, or copied to tp
(its grad summed over the heads of every rank).

RoPE: rotate-half over the R dims (model/rope.py's tables of width R). DeepSeek's checkpoints lay the R
dims out interleaved (transformers' rope_interleave); hf.py permutes those weight rows at import and back
at export, which is exact (the same permutation of q's and k's R dims leaves q·k unchanged).
YaRN's DeepSeek mscale: the softmax scale is Q^-1/2 · mscale(factor, mscale_all_dim)^2 (transformers'
yarn_apply_mscale); the queries are multiplied by the square so every kernel keeps its Q^-1/2.
The cp kernels hold K and V at one width: V is padded with zeros to Q there (the zero columns give zero
outputs, cut after), so they run unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megaframe.config.schema import ModelConfig
from megaframe.layers.linear import ColumnParallelLinear, RowParallelLinear
from megaframe.layers.norm import Norm
from megaframe.layers.shard import Shard, sharded_param
from megaframe.model.attention import Attention, apply_rope, position_rows
from megaframe.model.kv_cache import LayerKV
from megaframe.parallel import comm
from megaframe.parallel.mesh import Axis


def softmax_mscale(cfg: ModelConfig) -> float:
    """mscale(factor, mscale_all_dim)^2 under YaRN with mscale_all_dim (DeepSeek), else 1."""
    rs = cfg.rope_scaling
    if str(rs.rope_type) != "yarn" or not rs.mscale_all_dim or rs.factor <= 1:
        return 1.0
    m = 0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1.0
    return m * m


class Replicated(nn.Module):
    """A bias-free linear replicated over tp, on this rank's tokens (grads partial over tp under sp)."""

    def __init__(self, in_features: int, out_features: int, sp: bool, device=None):
        super().__init__()
        self.weight = sharded_param(Shard((out_features, in_features)), device, tp_partial_grad=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MLA(Attention):
    """Attention's kernels (its _core and what they read) under MLA's projections; see the module doc."""

    def __init__(
        self,
        cfg: ModelConfig,
        tp: Axis,
        sp: bool,
        device=None,
        recompute_core: bool = False,
        cp: Axis | None = None,
        cp_ring: bool = False,
    ):
        nn.Module.__init__(self)  # not Attention's projections: its kernels' settings only
        self.kernel_settings(cfg, tp, recompute_core, cp, cp_ring)
        self.sp = sp
        h, n, r, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.heads, self.nope, self.rope_dim, self.v_dim = h // tp.size, n, r, v
        self.head_dim = n + r  # the query/key width Q (Attention's name)
        self.kv_lora = cfg.kv_lora_rank
        d, eps = cfg.hidden_size, cfg.norm_eps
        if cfg.q_lora_rank:
            self.q_a_proj = Replicated(d, cfg.q_lora_rank, sp, device)
            self.q_norm = Norm("rmsnorm", cfg.q_lora_rank, eps, sp, device)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, [h * (n + r)], tp, sp, False, device)
        else:
            self.q_proj = ColumnParallelLinear(d, [h * (n + r)], tp, sp, False, device)
        self.kv_a_proj = Replicated(d, cfg.kv_lora_rank + r, sp, device)
        self.kv_norm = Norm("rmsnorm", cfg.kv_lora_rank, eps, sp, device)
        self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, [h * (n + v)], tp, sp, False, device)
        self.out_proj = RowParallelLinear(h * v, d, tp, sp, False, device)
        self.mscale = softmax_mscale(cfg)

    def _queries(self, x_SBD: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x_SBD)
        return self.q_b_proj(self.q_norm(self.q_a_proj(x_SBD)))

    def _qkv(self, x_SBD: torch.Tensor, rope, kv: LayerKV | None):
        """q_SBHQ, k_SBHQ, v_SBHV of this rank's heads (the whole sequence under sp), RoPE applied."""
        h, n, r = self.heads, self.nope, self.rope_dim
        q_SBX = self._queries(x_SBD)
        s, b = q_SBX.shape[:2]
        c_SBC, r_SBR = self.kv_a_proj(x_SBD).split([self.kv_lora, r], dim=-1)
        k_SBX = self.kv_b_proj(self.kv_norm(c_SBC)).view(s, b, h, n + self.v_dim)
        k_SBHN, v_SBHV = k_SBX.split([n, self.v_dim], dim=-1)
        # the shared key meets only this rank's heads: its grad is summed over tp's (or sp's) ranks
        r_SBR = comm.gather_from_sp(r_SBR, self.tp) if self.sp else comm.copy_to_tp(r_SBR, self.tp)
        q_SBHN, q_SBHR = q_SBX.view(s, b, h, n + r).split([n, r], dim=-1)
        cos, sin = position_rows(*rope[:2], kv.pos if kv is not None else 0, s)
        q_SBHR, r_SB1R = apply_rope(q_SBHR, cos, sin), apply_rope(r_SBR.unsqueeze(2), cos, sin)
        q_SBHQ = torch.cat([q_SBHN, q_SBHR], dim=-1)
        if self.mscale != 1.0:
            q_SBHQ = q_SBHQ * self.mscale
        k_SBHQ = torch.cat([k_SBHN, r_SB1R.expand(s, b, h, r)], dim=-1)
        if self.owns_v(q_SBHQ, v_SBHV, kv):
            # k is a new tensor (the cat): the view v alone would keep kv_b_proj's whole [k_nope | v] output
            # for attention's backward
            v_SBHV = v_SBHV.contiguous()
        return q_SBHQ, k_SBHQ, v_SBHV

    def forward(self, x_SBD: torch.Tensor, rope, kv: LayerKV | None = None) -> torch.Tensor:
        q_SBHQ, k_SBHQ, v_SBHV = self._qkv(x_SBD, rope, kv)
        doc = rope[2] if len(rope) == 3 else None
        # Attention's core: the cache at MLA's own widths, V padded to Q for the cp kernels (the module doc)
        return self.out_proj(self.attend(q_SBHQ, k_SBHQ, v_SBHV, doc, kv))
