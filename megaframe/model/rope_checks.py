"""What a RoPE scaling (model.rope_scaling) needs before model/rope.py can compute its table, in a module
without torch: config/checks.py asks it in every process that loads a config, and a process that never
builds a model (data preparation and its workers) would otherwise import torch for it (~1.6 s of CPU)."""

from __future__ import annotations

from megaframe.config.schema import RopeScalingConfig


def scaling_problem(rs: RopeScalingConfig, position_embedding: str = "rope") -> str | None:
    """Why `rs` cannot be computed, or None (config/checks.py turns it into a ConfigError); a model whose
    positions are not RoPE has nothing to scale: a scaling there would be silently ignored."""
    kind = str(rs.rope_type)
    if kind == "default":
        return None
    if str(position_embedding) != "rope":
        return (
            f"rope_type={kind} scales RoPE, but model.position_embedding={position_embedding} (the model "
            "has no RoPE): drop model.rope_scaling"
        )
    if not rs.factor > 0:
        return f"rope_type={kind} needs factor > 0 (got {rs.factor})"
    if kind in ("llama3", "yarn") and not (rs.original_max_position_embeddings or 0) > 0:
        return f"rope_type={kind} needs original_max_position_embeddings (the pretraining context)"
    if kind == "llama3" and not rs.high_freq_factor > rs.low_freq_factor > 0:
        return (
            f"rope_type=llama3 needs high_freq_factor > low_freq_factor > 0 "
            f"(got {rs.high_freq_factor}, {rs.low_freq_factor})"
        )
    return None
