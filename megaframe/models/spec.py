"""What defines a model family, in one record: the block it builds, what a config of it must hold, its
Hugging Face adapter both ways, its parameter and FLOP counters and its presets.

Each family lives in its own folder (models/<family>/spec.py, and hf.py where its adapter is its own) and
is registered by name in models/registry.py; a config names its family (`model.family`, set in every
preset under conf/model/). The stage shell (model/gpt.py: embedding, positions, pipeline chunks, head and
loss) is every family's; the blocks between are the family's `block` builder's (model/block.py's
`build_block`, the shared block, unless the family brings its own).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from megaframe.config.schema import ModelConfig
from megaframe.models import counts


def requires(family: str, m: ModelConfig, **values) -> list[str]:
    """One line per model.* field of `m` that is not at the value `family` requires ([] when all are)."""
    return [
        f"model.{k}={_shown(getattr(m, k))} ({family} requires {_shown(v)})"
        for k, v in values.items()
        if getattr(m, k) != v
    ]


def _shown(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def adapter(module: str, name: str) -> Callable:
    """A family's transformers adapter function (its hf.py's to_hf, from_hf), imported at its first call: the
    config checks read every family's spec before any rank starts, and the adapters import torch."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = name
    return call


def shared_block(args, layer: int):
    """model/block.py's build_block, the shared block: imported when a block is built, so the config checks
    that read a family's spec (config/checks.py, the job script's check before any rank starts) import no
    torch."""
    from megaframe.model.block import build_block

    return build_block(args, layer)


@dataclass(frozen=True)
class FamilySpec:
    name: str
    """Registry key and model.family's value, e.g. 'llama'."""
    presets: tuple[str, ...]
    """conf/model/<preset>.yaml files of this family; the first is its tiny one (CPU tests build it)."""
    check: Callable[[ModelConfig], list[str]]
    """What a config of this family must hold: one line per model.* field that breaks it, [] when `m` is
    one (config/checks.py refuses model.family=NAME with a config it rejects)."""
    to_hf: Callable
    """(ModelConfig, full state, eos, bos) -> (transformers config, HF state_dict); ValueError naming what
    transformers' class cannot compute."""
    from_hf: Callable | None = None
    """(transformers config, fp32 HF state_dict) -> (ModelConfig fields, full megaframe state)."""
    hf_model_type: str | None = None
    """transformers' config.model_type the adapter reads (from_hf is chosen by it); None: no import."""
    hf_architecture: str | None = None
    """transformers class the export names in config.json (e.g. LlamaForCausalLM)."""
    block: Callable = shared_block
    """(model/block.py's BlockArgs, global layer index) -> the block (forward(x_SBD, rope, kv=None))."""
    layer_params: Callable = counts.layer_params
    """(ModelConfig, tp, ep) -> (dense, expert) parameters of one block on one rank."""
    outside_params: Callable = counts.outside_params
    """(ModelConfig, tp, first, last) -> parameters outside the blocks on a pipeline rank (read only where
    `stage_params` is None: a family that gives stage_params counts its ranks' ends there)."""
    stage_params: Callable | None = None
    """(ModelConfig, tp, ep, global block indices, first, last) -> (dense, expert) parameters of a pipeline
    rank, for a family whose blocks differ by index (dense and MoE blocks, extra blocks past the last);
    None: every block is `layer_params`' and the rest `outside_params`' (`rank_params`)."""
    flops_per_token: Callable = counts.flops_per_token
    """(ModelConfig, causal=False) -> model FLOPs per trained token (MFU's numerator)."""
    matmul_params: Callable = counts.matmul_params
    """ModelConfig -> matmul weights one token meets (training/metrics.py)."""
    owns: tuple[str, ...] = ()
    """model.* fields beyond the shared ones that only this family computes (e.g. MLA's widths): any
    other family refuses a config that sets one off its default (models/registry.py)."""

    @property
    def tiny(self) -> str:
        """The preset the CPU tests and the conformance test build."""
        return self.presets[0]

    def rank_params(
        self, m: ModelConfig, tp: int, ep: int, layers, first: bool, last: bool
    ) -> tuple[int, int]:
        """(dense, expert) parameters of a pipeline rank holding the blocks `layers` (global indices)."""
        if self.stage_params is not None:
            return self.stage_params(m, tp, ep, layers, first, last)
        dense, expert = self.layer_params(m, tp, ep)
        return len(layers) * dense + self.outside_params(m, tp, first, last), len(layers) * expert

    def total_params(self, m: ModelConfig) -> int:
        return sum(self.rank_params(m, 1, 1, range(m.num_layers), True, True))
