"""The closed string choices of the config, as StrEnums: Hydra refuses any other value at composition,
naming the field. A StrEnum member is a str (== its value; str() and format() give the value), so
comparisons with literals, dict keys and JSON keep working. megaframe.config.schema (and megaframe.config)
re-export them."""

from __future__ import annotations

from enum import StrEnum


class Norm(StrEnum):
    """model.norm."""

    rmsnorm = "rmsnorm"
    layernorm = "layernorm"


class Activation(StrEnum):
    """model.activation (MoE experts are SwiGLU only)."""

    swiglu = "swiglu"
    gelu = "gelu"


class PositionEmbedding(StrEnum):
    """model.position_embedding."""

    rope = "rope"
    learned = "learned"


class RopeType(StrEnum):
    """model.rope_scaling.rope_type: transformers' rope_type names (the ones a fixed table reproduces exactly;
    `dynamic` rescales with each call's length, so no trained table equals it)."""

    default = "default"
    linear = "linear"
    llama3 = "llama3"
    yarn = "yarn"


class RouterScore(StrEnum):
    """model.moe_router_score."""

    softmax = "softmax"
    sigmoid = "sigmoid"


# OmegaConf looks members up by name, and "1f1b" is no identifier: the functional form allows it. The
# names are pipeline/schedule.py's registered specs (plus auto), held equal to them by
# tests/unit/pipeline/test_schedule_specs.py: this leaf of the schema cannot import the pipeline.
ScheduleKind = StrEnum(
    "ScheduleKind",
    [
        (k, k)
        for k in (
            "auto",
            "gpipe",
            "1f1b",
            "interleaved",
            "zb_h1",
            "zbv",
            "1f1b_overlap",
            "interleaved_overlap",
        )
    ],
    module=__name__,
)
ScheduleKind.__doc__ = (
    "parallel.pp_schedule (auto: interleaved when vpp > 1, else 1f1b; zb_h1 and zbv: zero-bubble, "
    "backward split into input and weight gradients, zbv in a V over vpp=2; 1f1b_overlap and "
    "interleaved_overlap: each steady forward runs beside another micro-batch's backward, so one's "
    "all-to-alls overlap the other's compute, Megatron's moe_a2a_overlap)."
)


class Device(StrEnum):
    """train.device."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Precision(StrEnum):
    """train.precision."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp8 = "fp8"


class Fp8Recipe(StrEnum):
    """train.fp8_recipe: torchao's float8 scaling recipes."""

    tensorwise = "tensorwise"
    rowwise = "rowwise"


class GradReduceDtype(StrEnum):
    """optim.grad_reduce_dtype: the dtype gradients accumulate and are reduced over data parallel in."""

    fp32 = "fp32"
    bf16 = "bf16"


class StateDtype(StrEnum):
    """optim.state_dtype: the dtype of the update rule's per-element state (the master stays fp32)."""

    fp32 = "fp32"
    bf16 = "bf16"


class StepKernel(StrEnum):
    """optim.step_kernel: how AdamW's update of an owned range runs (torch's fused kernel, or one compiled
    pass that also writes the bf16 parameter)."""

    eager = "eager"
    compiled = "compiled"


class MuonAdjustLR(StrEnum):
    """optim.muon.adjust_lr_fn: how Muon scales its lr by a matrix's shape A x B (torch.optim.Muon's)."""

    original = "original"
    match_rms_adamw = "match_rms_adamw"


class Recompute(StrEnum):
    """train.recompute (op_selective: torch's selective activation checkpointing per block with torchtitan's
    op-level policy, model/recompute.py)."""

    none = "none"
    selective = "selective"
    full = "full"
    op_selective = "op_selective"


class DataKind(StrEnum):
    """data.kind."""

    prepared = "prepared"
    synthetic = "synthetic"


class WandbMode(StrEnum):
    """logging.wandb.mode."""

    online = "online"
    offline = "offline"
    disabled = "disabled"


# `continue` is a keyword: the functional form again (OmegaConf needs name == value)
SaveErrorPolicy = StrEnum("SaveErrorPolicy", [(k, k) for k in ("stop", "continue")], module=__name__)
SaveErrorPolicy.__doc__ = "checkpoint.on_save_error."


class LRSchedule(StrEnum):
    """Shape of the learning rate after warmup (megaframe/optim/lr_schedule.py has the formulas)."""

    cosine = "cosine"
    linear = "linear"
    wsd = "wsd"
    constant = "constant"


class DocSplit(StrEnum):
    """How a plain-text file becomes documents (jsonl / json / parquet: one document per record)."""

    file = "file"
    paragraph = "paragraph"


class EPDispatch(StrEnum):
    """How the tokens reach their experts over ep (megaframe/model/moe/dispatcher.py)."""

    all_to_all = "all_to_all"
    node = "node"


class CPComm(StrEnum):
    """How context-parallel ranks see each other's keys and values (megaframe/parallel/context.py)."""

    allgather = "allgather"
    ring = "ring"
