"""RoPE settings between megaframe (model.rope_theta, model.rope_scaling) and transformers configs, for
every RoPE family: transformers >= 5 keeps them in `rope_parameters` (rope_type, rope_theta and the
scaling's fields), 4.x in `rope_theta` plus a `rope_scaling` dict (`type` in old configs)."""

from __future__ import annotations

import dataclasses

from megaframe.config.schema import RopeScalingConfig, RopeType

# the fields each rope_type reads (model/rope.py); the rest keep their defaults
FIELDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
}


def rope_config(cls, kw: dict, theta: float, rs: RopeScalingConfig, arch: str):
    """`cls(**kw)` (a transformers config class) carrying the RoPE base and scaling, architectures=[arch]."""
    kind = str(rs.rope_type)
    params = {k: getattr(rs, k) for k in FIELDS[kind] if getattr(rs, k) is not None}
    if kind == "yarn" and params.get("truncate", True):
        params.pop("truncate")  # transformers' default; older versions reject the key
    if "rope_parameters" in cls().to_dict():  # transformers >= 5
        kw["rope_parameters"] = {"rope_type": kind, "rope_theta": theta, **params}
    else:
        kw["rope_theta"] = theta
        if kind != "default":
            kw["rope_scaling"] = {"rope_type": kind, **params}
    cfg = cls(**kw)
    cfg.architectures = [arch]
    return cfg


def rope_type(params: dict) -> str:
    """The rope_type of a transformers RoPE dict (rope_parameters, or 4.x's rope_scaling); ValueError naming
    one megaframe cannot reproduce exactly."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in FIELDS:
        why = (
            ": its frequencies follow each call's length, so no fixed table reproduces it"
            if kind == "dynamic"
            else ""
        )
        raise ValueError(f"RoPE scaling {kind!r} is not supported (supported: {', '.join(FIELDS)}){why}")
    return kind


def refuse_folder_rope_type(folder) -> None:
    """rope_type's refusal read from a transformers folder's config.json alone, before its weights load:
    loading the model first (transformers' modeling imports, the weights) made that refusal take seconds.
    An unreadable config, or one with no single RoPE dict, is left to the load that follows."""
    import json
    from pathlib import Path

    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return
    for key in ("rope_parameters", "rope_scaling"):
        params = raw.get(key) if isinstance(raw, dict) else None
        if isinstance(params, dict) and ("rope_type" in params or "type" in params):
            rope_type(params)


def rope_from_hf(cfg) -> tuple[float, RopeScalingConfig]:
    """(rope_theta, scaling) of a transformers config; ValueError naming a rope_type megaframe cannot
    reproduce exactly (dynamic NTK rescales per call length, longrope switches tables by length)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if not params:  # transformers 4: rope_theta beside an optional rope_scaling dict
        scaling = getattr(cfg, "rope_scaling", None) or {}
        params = {"rope_theta": getattr(cfg, "rope_theta", 10000.0), **scaling}
    kind = rope_type(params)
    if kind == "yarn" and params.get("factor") is None:  # DeepSeek-style: transformers derives it
        params["factor"] = cfg.max_position_embeddings / params["original_max_position_embeddings"]
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"partial_rotary_factor={params['partial_rotary_factor']} is not supported "
            "(megaframe rotates the whole head)"
        )
    names = {f.name: f for f in dataclasses.fields(RopeScalingConfig)}
    fields = {k: params[k] for k in FIELDS[kind] if params.get(k) is not None}
    cast = {"original_max_position_embeddings": int, "truncate": bool}
    fields = {k: cast.get(k, float)(v) for k, v in fields.items() if k in names}
    return float(params.get("rope_theta", 10000.0)), RopeScalingConfig(rope_type=RopeType(kind), **fields)
