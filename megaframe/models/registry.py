"""The model families by name: adding one is a folder (models/<family>/spec.py) and one line here.

Order matters only for `family_of`: the first family whose spec claims a config exports it (each spec's
`mismatch` is written so at most one claims any config)."""

from __future__ import annotations

from megaframe.config.schema import ModelConfig
from megaframe.models.gpt2.spec import SPEC as GPT2
from megaframe.models.llama.spec import SPEC as LLAMA
from megaframe.models.mixtral.spec import SPEC as MIXTRAL
from megaframe.models.qwen3.spec import SPEC as QWEN3
from megaframe.models.spec import FamilySpec

FAMILIES: dict[str, FamilySpec] = {s.name: s for s in (LLAMA, GPT2, MIXTRAL, QWEN3)}


def family(name: str) -> FamilySpec:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r} (registered: {', '.join(FAMILIES)})")
    return FAMILIES[name]


def family_of(m: ModelConfig) -> FamilySpec:
    """The family whose transformers architecture computes exactly what `m` computes; ValueError naming,
    per family, why none does."""
    reasons = {}
    for spec in FAMILIES.values():
        why = spec.mismatch(m)
        if not why:
            return spec
        reasons[spec.name] = "; ".join(why)
    raise ValueError(
        "no transformers architecture matches this model: "
        + " | ".join(f"not {k}: {v}" for k, v in reasons.items())
    )


def counting_family(m: ModelConfig) -> FamilySpec:
    """The family whose counters count `m` (family_of, else Llama's: every family configures the shared
    transformer, whose generic counters fit any config, HF-exportable or not)."""
    try:
        return family_of(m)
    except ValueError:
        return LLAMA


def by_model_type(model_type: str) -> FamilySpec:
    """The family importing a transformers config.model_type."""
    for spec in FAMILIES.values():
        if spec.hf_model_type == model_type:
            return spec
    raise ValueError(
        f"unsupported transformers model_type {model_type!r} "
        f"(supported: {', '.join(s.hf_model_type for s in FAMILIES.values())})"
    )


def preset_family(preset: str) -> FamilySpec:
    """The family that lists conf/model/<preset>.yaml among its presets."""
    for spec in FAMILIES.values():
        if preset in spec.presets:
            return spec
    raise ValueError(f"preset {preset!r} belongs to no registered family")
