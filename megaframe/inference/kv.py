"""Incremental decoding with a key/value cache, on a one-process model (megaframe.load_model's).

The cached forward is the model's own forward with a cache argument (`model(ids, kv_cache=cache)`): each
block's attention reads the earlier positions' keys and values from the cache instead of recomputing them
and appends the new ones (model/kv_cache.py), so generation knows no block internals and every family
decodes through its own block. `forward_full` (no cache) is the reference and the baseline of the
tokens/s comparison.

Legend: B batch, S new positions this call, V vocab rows.
"""

from __future__ import annotations

import torch

from megaframe.model.kv_cache import KVCache


def new_cache(model, max_len: int | None = None) -> KVCache:
    """An empty cache for up to max_len positions (default: model.seq_length, the most there can be)."""
    return KVCache(max_len or model.cfg.seq_length)


def check_one_process(model) -> None:
    if model.mesh.tp.size != 1 or not (model.stage.first and model.stage.last):
        raise ValueError("generation runs on a one-process model (megaframe.load_model); got a sharded one")


@torch.no_grad()
def forward_cached(model, ids_BS: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits [B, S, V] of the new tokens ids_BS at positions cache.length.., extending the cache."""
    return model(ids_BS, kv_cache=cache)


@torch.no_grad()
def forward_full(model, ids_BS: torch.Tensor) -> torch.Tensor:
    """Logits [B, S, V] of a whole sequence by the training forward (no cache)."""
    return model(ids_BS)
