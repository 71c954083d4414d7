"""Causal self-attention with GQA and RoPE, tensor-parallel over heads.

Legend: S sequence (full inside attention; this cp rank's S/cp under context parallelism), T the cp
group's gathered K/V tokens, B batch, D hidden, H query heads on this rank (heads/tp),
K kv heads on this rank (groups/tp), E head dim.
qkv: ColumnParallelLinear with blocks [q | k | v] = [heads·E | groups·E | groups·E], each split over tp.
out_proj: RowParallelLinear [D, heads·E], input split by head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from megaframe.config.schema import ModelConfig
from megaframe.layers.linear import ColumnParallelLinear, RowParallelLinear
from megaframe.layers.norm import Norm
from megaframe.layers.rng import tp_distinct
from megaframe.model import rope
from megaframe.model.documents import DocContext, doc_flex_attention
from megaframe.model.kv_cache import LayerKV, cached_attention
from megaframe.parallel import comm
from megaframe.parallel.context import cp_causal_bias
from megaframe.parallel.cp_attention import cp_chunked_attention, cp_global_order
from megaframe.parallel.eager import eager
from megaframe.parallel.mesh import Axis
from megaframe.parallel.ring_attention import ring_attention

SDPA_PRIORITY = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
"""CUDA SDPA backends on Hopper (sm90), first usable wins: cuDNN's kernels there are 1.2-1.9x
FlashAttention-2's at head dim 64-128 (pytorch#142132, #122510); its grads are checked against flash in
tests/gpu."""

SDPA_PRIORITY_ELSEWHERE = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""Every other CUDA device: flash first, no cuDNN. On A100 cuDNN's SDPA is slower than flash
(transformers#48163: 0.82x), on Blackwell RTX too (0.88x), and on B200 torch 2.13's cuDNN SDPA gives wrong
outputs with fewer than 8 KV heads (pytorch#193893), where torch's own order would put it first."""


def sdpa_priority(capability: tuple[int, int]) -> list[SDPBackend]:
    """The SDPA backend order for a CUDA device of this compute capability: cuDNN first only where it wins
    and is correct (Hopper, (9, 0)); flash first elsewhere."""
    return SDPA_PRIORITY if tuple(capability) == (9, 0) else SDPA_PRIORITY_ELSEWHERE


def causal_sdpa(
    q_BHSE: torch.Tensor, k_BKSE: torch.Tensor, v_BKSE: torch.Tensor, dropout: float, gqa: bool
) -> torch.Tensor:
    """Causal SDPA; on CUDA under sdpa_priority(the device's capability) (a context torch.compile traces;
    the global order is restored)."""
    if not q_BHSE.is_cuda:
        return F.scaled_dot_product_attention(
            q_BHSE, k_BKSE, v_BKSE, is_causal=True, dropout_p=dropout, enable_gqa=gqa
        )
    # get_device_properties is constant-folded by dynamo: no graph break, no guard per call
    props = torch.cuda.get_device_properties(q_BHSE.device)
    with sdpa_kernel(sdpa_priority((props.major, props.minor)), set_priority=True):
        return F.scaled_dot_product_attention(
            q_BHSE, k_BKSE, v_BKSE, is_causal=True, dropout_p=dropout, enable_gqa=gqa
        )


def rope_tables(seq: int, dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_SE, sin_SE for the rotate-half RoPE used by Llama (plain; model/rope.py scales)."""
    return rope.rope_tables(seq, dim, theta, device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the last dim (E); cos/sin broadcast against x (e.g. [S, 1, 1, E] for x_SBHE)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def position_rows(
    cos: torch.Tensor, sin: torch.Tensor, start: int, s: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_S11E, sin_S11E of the s positions from `start` (a decoding cache's next position, else 0), shaped
    to broadcast over x_SBHE; document masking's per-sample tables ([S, B, 1, E]) as they are."""
    if cos.dim() == 4:
        return cos, sin
    return cos[start : start + s, None, None, :], sin[start : start + s, None, None, :]


# eager under train.compile: dynamo would trace through the cache and rebuild the bias inside the graph
_cp_bias = eager(cp_causal_bias)


class Attention(nn.Module):
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
        super().__init__()
        self.kernel_settings(cfg, tp, recompute_core, cp, cp_ring)
        e = cfg.head_dim
        # Whole heads per rank (config/checks.py requires tp to divide both): attention never crosses ranks.
        self.heads, self.groups, self.head_dim = (
            cfg.num_attention_heads // tp.size,
            cfg.kv_heads // tp.size,
            e,
        )
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size,
            [cfg.num_attention_heads * e, cfg.kv_heads * e, cfg.kv_heads * e],
            tp,
            sp,
            cfg.bias,
            device,
        )
        self.out_proj = RowParallelLinear(
            cfg.num_attention_heads * e, cfg.hidden_size, tp, sp, cfg.bias, device
        )
        if cfg.qk_norm:
            # [E] weights shared by every head; each tp rank normalises only its own heads, so the grads are
            # partial over tp (summed before the step) whenever tp > 1, sp or not
            self.q_norm = Norm("rmsnorm", e, cfg.norm_eps, tp.size > 1, device)
            self.k_norm = Norm("rmsnorm", e, cfg.norm_eps, tp.size > 1, device)

    def kernel_settings(
        self, cfg: ModelConfig, tp: Axis, recompute_core: bool, cp: Axis | None, cp_ring: bool
    ) -> None:
        """What the attention core reads (attend, _core): the cp group and its kernel, selective recompute,
        the dropout; set by every attention whatever its projections (models/deepseek_v3/mla.py)."""
        self.cp = cp if cp is not None and cp.size > 1 else None
        self.cp_ring, self.seq = cp_ring and self.cp is not None, cfg.seq_length
        # causal by global position: this rank's queries against the cp group's gathered K/V, per query
        # chunk without a mask (cp_attention.py); with attention dropout one SDPA call under the shared
        # [S/c, S] bias (context.cp_causal_bias, built on first use)
        self.cp_gathered = self.cp is not None and not self.cp_ring
        self.ring_overlap = True  # benchmarks/bench_cp.py turns it off to time the exchange unhidden
        self.ring_tile_elems: int | None = None  # ring_attention's tile (None: the device's default)
        self.ring_fused = True  # benchmarks/bench_cp.py turns it off to time the fp32 math ring
        self.recompute_core, self.dropout, self.tp = recompute_core, cfg.dropout, tp

    def norm_qk(self, q_SBHE: torch.Tensor, k_SBKE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's per-head RMSNorm of queries and keys (model.qk_norm), before RoPE; else as they are."""
        if not hasattr(self, "q_norm"):
            return q_SBHE, k_SBKE
        return self.q_norm(q_SBHE), self.k_norm(k_SBKE)

    def forward(
        self, x_SBD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, kv: LayerKV | None = None
    ) -> torch.Tensor:
        """Attention of x_SBD's tokens; with `kv` (decoding, model/kv_cache.py) over the cached positions
        too, the new tokens continuing at kv.pos."""
        qkv_SBX = self.qkv(x_SBD)
        s, b = qkv_SBX.shape[:2]
        h, k, e = self.heads, self.groups, self.head_dim
        q, kk, v = qkv_SBX.split([h * e, k * e, k * e], dim=-1)
        q_SBHE, k_SBKE = self.norm_qk(q.view(s, b, h, e), kk.view(s, b, k, e))
        # rope: (cos_SE, sin_SE); under document masking
        # (cos_SB1E, sin_SB1E, DocContext), cos None for learned
        cos, sin = rope[:2] if rope is not None else (None, None)
        doc = rope[2] if rope is not None and len(rope) == 3 else None
        if cos is not None:  # before the permute: rows of E stay contiguous, so the rotation streams
            cos_S11E, sin_S11E = position_rows(cos, sin, kv.pos if kv is not None else 0, s)
            q_SBHE, k_SBKE = apply_rope(q_SBHE, cos_S11E, sin_S11E), apply_rope(k_SBKE, cos_S11E, sin_S11E)
        v_SBKE = v.view(s, b, k, e)
        if cos is not None and not hasattr(self, "q_norm") and self.owns_v(q_SBHE, v_SBKE, kv):
            # q and k are rotated copies now, so the view v would be the only thing keeping the whole
            # [q | k | v] output alive: attention saves its inputs for backward. Its own copy (k of h + 2k
            # heads) lets the rest go after forward: 34 MiB a layer a micro-batch at 405B tp8
            v_SBKE = v_SBKE.contiguous()
        return self.out_proj(self.attend(q_SBHE, k_SBKE, v_SBKE, doc, kv))

    def owns_v(self, q: torch.Tensor, v: torch.Tensor, kv: LayerKV | None) -> bool:
        """Whether to copy v, a view of its projection's output, before attention, where the caller knows
        nothing else keeps that output for backward: not when the cp kernels make a new V anyway (the
        all-gather, or the padding to the query width), nor when decoding (no backward)."""
        copied_anyway = self.cp is not None and (self.cp_gathered or v.shape[-1] != q.shape[-1])
        return kv is None and torch.is_grad_enabled() and not copied_anyway

    def attend(
        self,
        q_SBHE: torch.Tensor,
        k_SBKE: torch.Tensor,
        v_SBKV: torch.Tensor,
        doc: DocContext | None,
        kv: LayerKV | None,
    ) -> torch.Tensor:
        """The attention core of this rank's heads, RoPE applied, as [S, B, H·V] (V: the value width, which
        may differ from the query/key width E): through the decoding cache, else the cp group's gathered
        K/V or its ring, under selective recompute, by _core's kernels."""
        s, b, h, e, vd = *q_SBHE.shape[:3], q_SBHE.shape[-1], v_SBKV.shape[-1]
        if kv is not None:  # written before attending: each new position attends to itself too
            # cached at their own widths (model/kv_cache.py)
            k_BKTE, v_BKTV = kv.extend(k=k_SBKE.permute(1, 2, 0, 3), v=v_SBKV.permute(1, 2, 0, 3))
            o_BHSV = cached_attention(q_SBHE.permute(1, 2, 0, 3), k_BKTE, v_BKTV, kv.pos)
            return o_BHSV.permute(2, 0, 1, 3).reshape(s, b, h * vd)
        if self.cp is not None and vd != e:
            # the cp kernels hold K and V at one width: V padded with zeros (zero outputs, cut below)
            v_SBKV = F.pad(v_SBKV, (0, e - vd))
        if self.cp_gathered:
            # the whole sequence's K/V (after RoPE: each rotated at its own position)
            k_SBKE, v_SBKV = comm.gather_from_cp(k_SBKE, self.cp), comm.gather_from_cp(v_SBKV, self.cp)
        q_BHSE, k_BKSE, v_BKSV = (t.permute(1, 2, 0, 3) for t in (q_SBHE, k_SBKE, v_SBKV))
        if self.recompute_core and self.training and torch.is_grad_enabled():
            # selective recompute (Megatron): drop what SDPA saved for backward (probabilities, or the
            # flash/efficient kernels' logsumexp) and re-run it in backward; RNG state is restored
            o_BHSX = checkpoint(self._core, q_BHSE, k_BKSE, v_BKSV, doc, use_reentrant=False)
        else:
            o_BHSX = self._core(q_BHSE, k_BKSE, v_BKSV, doc)
        if o_BHSX.shape[-1] != vd:  # the padded V's zero columns
            o_BHSX = o_BHSX[..., :vd]
        return o_BHSX.permute(2, 0, 1, 3).reshape(s, b, h * vd)

    def _core(
        self, q_BHSE: torch.Tensor, k_BKSE: torch.Tensor, v_BKSE: torch.Tensor, doc: DocContext | None = None
    ) -> torch.Tensor:
        """Causal SDPA: is_causal and no mask tensor, so flash / memory-efficient kernels apply (document
        masking: its kernel, _documents). The heads are split over tp: attention dropout draws per tp
        rank (layers.rng)."""
        if self.training and self.dropout > 0 and self.tp.size > 1:
            with tp_distinct(self.tp, q_BHSE.device):
                return self._sdpa(q_BHSE, k_BKSE, v_BKSE, doc)
        return self._sdpa(q_BHSE, k_BKSE, v_BKSE, doc)

    def _sdpa(
        self, q_BHSE: torch.Tensor, k_BKSE: torch.Tensor, v_BKSE: torch.Tensor, doc: DocContext | None = None
    ) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        gqa = q_BHSE.shape[1] != k_BKSE.shape[1]
        if doc is not None:
            return self._documents(q_BHSE, k_BKSE, v_BKSE, doc, dropout)
        if self.cp_ring:  # K/V blocks passed around the cp ring (parallel/ring_attention.py)
            # dropout drawn as the all-gather branch's SDPA draws it (ring_attention.py)
            return ring_attention(
                q_BHSE,
                k_BKSE,
                v_BKSE,
                self.cp,
                self.seq,
                self.ring_overlap,
                self.ring_tile_elems,
                dropout_p=dropout,
                fused=self.ring_fused,
            )
        if self.cp_gathered and dropout == 0:  # per query chunk, no mask tensor
            return cp_chunked_attention(q_BHSE, k_BKSE, v_BKSE, self.seq, self.cp.size, self.cp.rank)
        if self.cp_gathered:
            # dropout: one SDPA call draws one [B, H, Q, T] mask, the draw the ring reproduces
            # (ring_attention.py); queries and keys are not aligned: an explicit global-position mask
            bias_QT = _cp_bias(self.seq, self.cp.size, self.cp.rank, q_BHSE.device, q_BHSE.dtype)
            return F.scaled_dot_product_attention(
                q_BHSE, k_BKSE, v_BKSE, attn_mask=bias_QT, dropout_p=dropout, enable_gqa=gqa
            )
        return causal_sdpa(q_BHSE, k_BKSE, v_BKSE, dropout, gqa)

    def _documents(
        self,
        q_BHQE: torch.Tensor,
        k_BKTE: torch.Tensor,
        v_BKTE: torch.Tensor,
        doc: DocContext,
        dropout: float,
    ) -> torch.Tensor:
        """Causal within each document (model/documents.py); K/V: the whole sample's (one process, sp), the
        cp group's gathered in cp-rank order (allgather), or this rank's block (ring)."""
        if doc.kernel == "ring":  # each K/V block masked by its own documents' ids (ring_attention.py)
            return ring_attention(
                q_BHQE,
                k_BKTE,
                v_BKTE,
                self.cp,
                self.seq,
                self.ring_overlap,
                self.ring_tile_elems,
                dropout_p=dropout,
                fused=self.ring_fused,
                doc_BS=doc.doc_BS,
            )
        if doc.kernel == "flex":  # no [Q, T] mask; no dropout (the model picks sdpa then)
            if self.cp_gathered:  # global order: the block mask's causal tiles are contiguous (skipped whole)
                k_BKTE, v_BKTE = cp_global_order(k_BKTE, self.cp.size), cp_global_order(v_BKTE, self.cp.size)
            return doc_flex_attention(q_BHQE, k_BKTE, v_BKTE, doc.block_mask)
        return F.scaled_dot_product_attention(
            q_BHQE,
            k_BKTE,
            v_BKTE,
            attn_mask=doc.mask_B1QT,
            dropout_p=dropout,
            enable_gqa=q_BHQE.shape[1] != k_BKTE.shape[1],
        )
