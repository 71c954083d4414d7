"""Incremental decoding with a key/value cache, on a one-process model (megaframe.load_model's).

The cached forward reuses the model's own modules (norms, qkv / out projections, MLP or MoE, head), so
it computes what GPT.forward computes; only attention differs: keys and values of earlier positions are
read from the cache instead of being recomputed. `forward_full` (no cache) is the reference and the
baseline of the tokens/s comparison.

Legend: B batch, S new positions this call, T cached + new positions, D hidden, H query heads,
K kv heads, E head dim, V vocab rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megaframe.layers.vocab import parallel_logits
from megaframe.model.attention import apply_rope


@dataclass
class KVCache:
    """Per layer: k_BKTE, v_BKTE preallocated to max_len positions; `length` positions are filled."""

    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]
    length: int = 0

    @classmethod
    def empty(cls, model, batch: int, max_len: int) -> "KVCache":
        cfg = model.cfg
        p = next(model.parameters())
        shape = (batch, cfg.kv_heads, max_len, cfg.head_dim)
        layers = [int(i) for i in model.layers]
        # zeros: positions past `length` are never read (the slices stop at pos + s) but stay defined
        return cls(
            {i: torch.zeros(shape, dtype=p.dtype, device=p.device) for i in layers},
            {i: torch.zeros(shape, dtype=p.dtype, device=p.device) for i in layers},
        )


def check_one_process(model) -> None:
    if model.mesh.tp.size != 1 or not (model.stage.first and model.stage.last):
        raise ValueError("generation runs on a one-process model (megaframe.load_model); got a sharded one")


def _attend(attn, x_SBD: torch.Tensor, rope, cache: KVCache, layer: int) -> torch.Tensor:
    """Attention of the S new positions over the cache plus themselves; appends their k, v."""
    qkv_SBX = attn.qkv(x_SBD)
    s, b = qkv_SBX.shape[:2]
    h, k, e = attn.heads, attn.groups, attn.head_dim
    pos = cache.length
    q, kk, v = qkv_SBX.split([h * e, k * e, k * e], dim=-1)
    q_SBHE, k_SBKE = attn.norm_qk(q.view(s, b, h, e), kk.view(s, b, k, e))
    if rope is not None:
        # absolute positions: the new tokens continue at the cache's length
        cos_S11E, sin_S11E = rope[0][pos : pos + s, None, None, :], rope[1][pos : pos + s, None, None, :]
        q_SBHE, k_SBKE = apply_rope(q_SBHE, cos_S11E, sin_S11E), apply_rope(k_SBKE, cos_S11E, sin_S11E)
    # written before attending: each new position attends to itself too
    cache.k[layer][:, :, pos : pos + s] = k_SBKE.permute(1, 2, 0, 3)
    cache.v[layer][:, :, pos : pos + s] = v.view(s, b, k, e).permute(1, 2, 0, 3)
    k_BKTE, v_BKTE = cache.k[layer][:, :, : pos + s], cache.v[layer][:, :, : pos + s]
    q_BHSE = q_SBHE.permute(1, 2, 0, 3)
    if pos == 0:  # prefill: plain causal attention (the training kernel)
        o_BHSE = F.scaled_dot_product_attention(q_BHSE, k_BKTE, v_BKTE, is_causal=True, enable_gqa=h != k)
    else:  # new position i (absolute pos + i) sees every cached position and the new ones up to itself
        # boolean mask: True = may attend (SDPA's convention)
        mask_ST = (
            torch.arange(pos + s, device=x_SBD.device)[None, :]
            <= (pos + torch.arange(s, device=x_SBD.device))[:, None]
        )
        o_BHSE = F.scaled_dot_product_attention(q_BHSE, k_BKTE, v_BKTE, attn_mask=mask_ST, enable_gqa=h != k)
    return attn.out_proj(o_BHSE.permute(2, 0, 1, 3).reshape(s, b, h * e))


def _embed(model, ids_BS: torch.Tensor, pos: int) -> torch.Tensor:
    x_SBD = model.embed(ids_BS.t())
    if model.cfg.position_embedding == "learned":
        x_SBD = x_SBD + model.pos_embed[pos : pos + ids_BS.shape[1]].unsqueeze(1)
    return x_SBD


def _head(model, x_SBD: torch.Tensor) -> torch.Tensor:
    x_SBD = model.final_norm(x_SBD)
    if model.cfg.tie_embeddings:
        return parallel_logits(x_SBD, model.embed.weight, model.mesh.tp, False).transpose(0, 1)
    return model.head(x_SBD).transpose(0, 1)


@torch.no_grad()
def forward_cached(model, ids_BS: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [B, S, V] of the new tokens ids_BS at positions cache.length.., extending the cache."""
    x_SBD = _embed(model, ids_BS, cache.length)
    for i in sorted(int(i) for i in model.layers):
        block = model.layers[str(i)]
        x_SBD = x_SBD + _attend(block.attn, block.attn_norm(x_SBD), model.rope, cache, i)
        x_SBD = x_SBD + block.mlp(block.mlp_norm(x_SBD))
    # once per call, after every layer wrote at the same positions
    cache.length += ids_BS.shape[1]
    return _head(model, x_SBD)


@torch.no_grad()
def forward_full(model, ids_BS: torch.Tensor) -> torch.Tensor:
    """Logits [B, S, V] of a whole sequence by the training forward (no cache)."""
    return model(ids_BS)
