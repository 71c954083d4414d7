"""The model families by name: adding one is a folder (models/<family>/spec.py) and one line here.

A config names its family (model.family); `spec_of` reads it. A config that names none (one built by
hand, or recorded before the key existed) gets the first family here whose check accepts it (`infer`):
`custom`, which accepts any combination of the shared block's switches, comes last."""

from __future__ import annotations

import dataclasses

from megaframe.config.schema import ModelConfig
from megaframe.models.custom.spec import SPEC as CUSTOM
from megaframe.models.deepseek_v3.spec import SPEC as DEEPSEEK_V3
from megaframe.models.gpt2.spec import SPEC as GPT2
from megaframe.models.llama.spec import SPEC as LLAMA
from megaframe.models.mixtral.spec import SPEC as MIXTRAL
from megaframe.models.qwen3.spec import SPEC as QWEN3
from megaframe.models.qwen3_moe.spec import SPEC as QWEN3_MOE
from megaframe.models.spec import FamilySpec

FAMILIES: dict[str, FamilySpec] = {
    s.name: s for s in (LLAMA, GPT2, MIXTRAL, QWEN3, QWEN3_MOE, DEEPSEEK_V3, CUSTOM)
}


def family(name: str) -> FamilySpec:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r} (registered: {', '.join(FAMILIES)})")
    return FAMILIES[name]


def foreign(spec: FamilySpec, m: ModelConfig) -> list[str]:
    """One line per field another family owns (FamilySpec.owns) that `m` sets off its default while
    naming `spec`: a family's positive check knows only its own fields."""
    default = ModelConfig()
    return [
        f"model.{k}={getattr(m, k)} ({spec.name} does not compute it; model.family={other.name} does)"
        for other in FAMILIES.values()
        if other is not spec
        for k in other.owns
        if k not in spec.owns and getattr(m, k) != getattr(default, k)
    ]


def fits(spec: FamilySpec, m: ModelConfig) -> list[str]:
    """Why `m` is not of `spec`'s family: its check's lines and the other families' fields it sets."""
    return spec.check(m) + foreign(spec, m)


def fitting(m: ModelConfig) -> FamilySpec | None:
    """The first registered family that `fits` `m`, or None (custom fits every config of the shared block,
    not one setting another family's fields)."""
    return next((spec for spec in FAMILIES.values() if not fits(spec, m)), None)


def infer(m: ModelConfig) -> FamilySpec:
    """`fitting`'s family; a config no family fits is custom's (and refused as such at load)."""
    return fitting(m) or FAMILIES["custom"]


def spec_of(m: ModelConfig) -> FamilySpec:
    """The family `m` names (model.family), else the inferred one."""
    return family(m.family) if m.family else infer(m)


def with_family(m: ModelConfig) -> ModelConfig:
    """`m` with model.family filled by `infer` when it names none (load_config's fill)."""
    return m if m.family else dataclasses.replace(m, family=infer(m).name)


def by_model_type(model_type: str) -> FamilySpec:
    """The family importing a transformers config.model_type."""
    for spec in FAMILIES.values():
        if spec.hf_model_type is not None and spec.hf_model_type == model_type:
            return spec
    raise ValueError(
        f"unsupported transformers model_type {model_type!r} "
        f"(supported: {', '.join(s.hf_model_type for s in FAMILIES.values() if s.hf_model_type)})"
    )


def preset_family(preset: str) -> FamilySpec:
    """The family that lists conf/model/<preset>.yaml among its presets."""
    for spec in FAMILIES.values():
        if preset in spec.presets:
            return spec
    raise ValueError(f"preset {preset!r} belongs to no registered family")


def refusal(m: ModelConfig) -> str | None:
    """Why `m` is not of the family it names (one line naming each field at fault and the family the
    fields fit), or None when it is."""
    try:
        spec = spec_of(m)
    except ValueError as e:
        return f"model.family={m.family}: {e}"
    why = fits(spec, m)
    if not why:
        return None
    other = fitting(m)
    if other is None:  # no family computes these fields together: none to point to
        return f"model.family={spec.name}: {'; '.join(why)}"
    what = (
        " (megaframe's configurable block: it trains, it does not export)" if other.name == "custom" else ""
    )
    return f"model.family={spec.name}: {'; '.join(why)}; these fields fit model.family={other.name}{what}"
