"""What defines a model family, in one record: how its model is built, which configs belong to it, its
Hugging Face adapter both ways, its parameter and FLOP counters and its presets.

Each family lives in its own folder (models/<family>/spec.py, and hf.py where its adapter is its own) and
is registered by name in models/registry.py; adding one is a new folder plus one registry line. Families
configure the shared transformer (model/gpt.py): `build` is model/parallelize.build_model unless a family
needs more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megaframe.config.schema import ModelConfig
from megaframe.models import counts


@dataclass(frozen=True)
class FamilySpec:
    name: str
    """Registry key, e.g. 'llama'."""
    hf_model_type: str
    """transformers' config.model_type the adapter reads (from_hf is chosen by it)."""
    hf_architecture: str
    """transformers class the export names in config.json (e.g. LlamaForCausalLM)."""
    presets: tuple[str, ...]
    """conf/model/<preset>.yaml files of this family."""
    mismatch: Callable[[ModelConfig], list[str]]
    """Why a ModelConfig is not of this family ([] when it is): the family whose list is empty exports it."""
    to_hf: Callable
    """(ModelConfig, full state, eos, bos) -> (transformers config, HF state_dict)."""
    from_hf: Callable
    """(transformers config, fp32 HF state_dict) -> (ModelConfig fields, full megaframe state)."""
    build: Callable | None = None
    """(run Config, Mesh) -> this rank's module; None = model/parallelize.build_model."""
    layer_params: Callable = counts.layer_params
    """(ModelConfig, tp, ep) -> (dense, expert) parameters of one block on one rank."""
    outside_params: Callable = counts.outside_params
    """(ModelConfig, tp, first, last) -> parameters outside the blocks on a pipeline rank."""
    flops_per_token: Callable = counts.flops_per_token
    """(ModelConfig, causal=False) -> model FLOPs per trained token (MFU's numerator)."""
    matmul_params: Callable = counts.matmul_params
    """ModelConfig -> matmul weights one token meets (training/metrics.py)."""

    def total_params(self, m: ModelConfig) -> int:
        return m.num_layers * sum(self.layer_params(m, 1, 1)) + self.outside_params(m, 1, True, True)

    def build_model(self, cfg, mesh):
        if self.build is not None:
            return self.build(cfg, mesh)
        from megaframe.model.parallelize import build_model

        return build_model(cfg, mesh)
