"""Figures a user checks a run by: model FLOPs per token (for MFU) and per-rank memory.

FLOPs per token of one training step (forward + backward = 3x forward), PaLM/Megatron convention:

    6 * N_matmul + 12 * L * S * (H * E)

N_matmul counts the weights of every matmul a token passes through (qkv, out_proj, MLP, output head;
the input embedding is a lookup and is not counted). The attention core (QK^T and AV) costs
2 * 2 * S * H*E per token per layer forward for full attention; we count it full, without the causal
1/2 discount, so MFU is comparable with published figures (causal=True halves that term).
"""
from __future__ import annotations

import time

import torch
from torch import nn

from megaframe.config import ModelConfig

# dense bf16 tensor-core peaks (no sparsity), FLOP/s
GPU_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def matmul_params(cfg: ModelConfig) -> int:
    d, e = cfg.hidden_size, cfg.head_dim
    attn = d * (cfg.num_attention_heads + 2 * cfg.kv_heads) * e + cfg.num_attention_heads * e * d
    mlp = (3 if cfg.activation == "swiglu" else 2) * d * cfg.ffn_hidden_size
    return cfg.num_layers * (attn + mlp) + cfg.vocab_size * d


def flops_per_token(cfg: ModelConfig, causal: bool = False) -> float:
    attn_core = 12 * cfg.num_layers * cfg.seq_length * cfg.num_attention_heads * cfg.head_dim
    return 6 * matmul_params(cfg) + (attn_core / 2 if causal else attn_core)


def peak_flops(device: torch.device) -> float:
    """Peak FLOP/s of one device: a table for GPUs; on CPU a short fp32 matmul measurement."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in GPU_PEAK.items() if k in name), 0.0)
    a = torch.randn(1024, 1024)
    torch.mm(a, a)  # warm-up
    best = 0.0
    for _ in range(5):  # best of five short windows: other processes may share the cores
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.05:
            torch.mm(a, a)
            n += 1
        best = max(best, 2 * 1024**3 * n / (time.perf_counter() - t0))
    return best


def memory_figures(model: nn.Module, optimizer, device: torch.device) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (and the CUDA peak)."""
    out = {"mem/params_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
           **optimizer.memory_bytes()}
    if device.type == "cuda":
        out["mem/peak_bytes"] = torch.cuda.max_memory_allocated(device)
    return out
