"""RoPE tables with Hugging Face's frequency scalings (model.rope_scaling).

A scaling changes only the inverse frequencies (and, for YaRN, multiplies cos/sin by one factor); positions
stay integers, so one fixed table per run reproduces transformers' rotary embedding exactly. The formulas
are transformers' modeling_rope_utils ones (`_compute_{linear_scaling,llama3,yarn}_parameters`), restated
over megaframe's config so the model needs no transformers config to build;
tests/unit/models/test_rope_scaling.py checks them against LlamaForCausalLM's logits. `dynamic` (NTK rescaled
per call length) and `longrope` (two tables switched by length) have no fixed table and are refused
(config/checks.py, import).
"""

from __future__ import annotations

import math

import torch

from megaframe.config.schema import RopeScalingConfig
from megaframe.model.rope_checks import scaling_problem  # noqa: F401  (its home before; the checks need no torch)


def inv_freq(
    dim: int, theta: float, rs: RopeScalingConfig | None = None, device=None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2] fp32, cos/sin scale) for head dim `dim`."""
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    kind = "default" if rs is None else str(rs.rope_type)
    if kind == "default":
        return base, 1.0
    if kind == "linear":
        return base / rs.factor, 1.0
    if kind == "llama3":
        return _llama3(base, rs), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, rs, device)
    raise ValueError(f"RoPE scaling {kind!r} is not supported (supported: default, linear, llama3, yarn)")


def _llama3(inv: torch.Tensor, rs: RopeScalingConfig) -> torch.Tensor:
    """Llama 3.1: long wavelengths (beyond the pretraining context / low_freq_factor) slowed by `factor`,
    short ones (below context / high_freq_factor) kept, a linear blend in wavelength-ratio between."""
    old = rs.original_max_position_embeddings
    low_wavelen, high_wavelen = old / rs.low_freq_factor, old / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, theta: float, rs: RopeScalingConfig, device) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023): per dim pair, interpolate (/ factor) the frequencies that turn fewer than
    beta_slow times over the pretraining context, keep those turning more than beta_fast times, ramp
    between; cos/sin are scaled by attention_factor (the paper's 0.1 ln(factor) + 1 unless given)."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, old = rs.factor, rs.original_max_position_embeddings
    attention = rs.attention_factor
    if attention is None:
        attention = (
            float(mscale(factor, rs.mscale) / mscale(factor, rs.mscale_all_dim))
            if rs.mscale and rs.mscale_all_dim
            else mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    extrapolate = 1 - ramp  # 1: keep the original frequency
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, attention


def rope_tables(
    seq: int, dim: int, theta: float, device=None, rs: RopeScalingConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_SE, sin_SE for the non-interleaved (rotate-half) RoPE used by Llama, with `rs`'s scaling."""
    # fp32 tables: at long positions bf16 angles would be off by whole radians.
    inv, scale = inv_freq(dim, theta, rs, device)
    ang = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos() * scale, ang.sin() * scale
