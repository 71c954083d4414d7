"""Qwen3 (dense) <-> megaframe: Llama's layout (models/llama/hf.py) plus the per-head q/k RMSNorms,
layers.{i}.attn.q_norm/k_norm.weight [E] = model.layers.{i}.self_attn.q_norm/k_norm.weight; no biases
(Qwen3's attention_bias, off in every released model, would bias attention only: megaframe's one `bias`
flag covers the MLP too, so it is refused); sliding-window layers are refused (megaframe attends to the
whole sequence)."""

from __future__ import annotations

import torch

from megaframe.config.schema import ModelConfig
from megaframe.models.hf_rope import rope_config
from megaframe.models.llama import hf as llama

QK_NORMS = {"attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"}


def to_hf(m: ModelConfig, state: dict, eos=None, bos=None):
    from transformers import Qwen3Config

    kw = dict(
        llama.common_kw(m, eos, bos),
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=m.num_layers,
    )
    cfg = rope_config(Qwen3Config, kw, m.rope_theta, m.rope_scaling, "Qwen3ForCausalLM")
    return cfg, llama.state_out(m, state, QK_NORMS)


def from_hf(cfg, sd: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    if getattr(cfg, "attention_bias", False):
        raise ValueError("Qwen3 attention_bias=true is not supported (megaframe's `bias` covers the MLP too)")
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        raise ValueError(
            f"Qwen3 sliding_window={cfg.sliding_window}: megaframe attends to the whole sequence"
        )
    fields = dict(llama.shape_fields(cfg, "hf_qwen3"), bias=False, qk_norm=True)
    return fields, llama.state_in(cfg, sd, False, QK_NORMS)
