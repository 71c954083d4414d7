"""The decoding cache a block's attention reads and extends: the model's own forward with `kv_cache` given
(GPT.forward(ids, kv_cache=cache)) decodes, so generation (megaframe/inference/) knows no block internals.

Each attention keeps what it needs under its layer's slot, allocated on its first write with the shapes it
writes: K and V may differ in width (MLA's v_head_dim), or a family may cache a latent instead.

Legend: B batch, S new positions this call, T cached + new positions, H query heads, K kv heads,
E head dim (Ek keys, Ev values).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    """Per layer: tensors preallocated to max_len positions; `length` positions are filled (the next call's
    tokens continue there). GPT.forward advances `length` once per call, after every layer wrote."""

    def __init__(self, max_len: int):
        self.max_len, self.length = max_len, 0
        self.slots: dict[int, dict[str, torch.Tensor]] = {}

    def layer(self, i: int) -> "LayerKV":
        return LayerKV(self, self.slots.setdefault(i, {}))


class LayerKV:
    """One layer's view of the cache: the position its new tokens start at, and its tensors."""

    def __init__(self, cache: KVCache, slot: dict[str, torch.Tensor]):
        self.cache, self.slot = cache, slot

    @property
    def pos(self) -> int:
        return self.cache.length

    def extend(self, **new_BXSE: torch.Tensor) -> list[torch.Tensor]:
        """Write each named [B, X, S, E] tensor at positions pos..pos+S; return each [B, X, T, E] so far."""
        pos, out = self.pos, []
        for name, t in new_BXSE.items():
            if name not in self.slot:
                # zeros: positions past `length` are never read (the slices stop at pos + s) but stay defined
                b, x, _, e = t.shape
                self.slot[name] = torch.zeros((b, x, self.cache.max_len, e), dtype=t.dtype, device=t.device)
            s = t.shape[2]
            self.slot[name][:, :, pos : pos + s] = t
            out.append(self.slot[name][:, :, : pos + s])
        return out


def cached_attention(q_BHSE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor, pos: int):
    """The S new queries (absolute positions pos..) over every cached key and the new ones up to each."""
    h, k = q_BHSE.shape[1], k_BKTE.shape[1]
    if pos == 0:  # prefill: plain causal attention (the training kernel)
        return F.scaled_dot_product_attention(q_BHSE, k_BKTE, v_BKTE, is_causal=True, enable_gqa=h != k)
    s, dev = q_BHSE.shape[2], q_BHSE.device
    # boolean mask: True = may attend (SDPA's convention)
    mask_ST = torch.arange(pos + s, device=dev)[None, :] <= (pos + torch.arange(s, device=dev))[:, None]
    return F.scaled_dot_product_attention(q_BHSE, k_BKTE, v_BKTE, attn_mask=mask_ST, enable_gqa=h != k)
