"""FP8 GEMMs for the blocks' linears (`train.precision=fp8`), through torchao's float8 training.

Legend: N tokens (flattened sequence x batch), I input features, O output features.

The scaling (dynamic, tensorwise or rowwise), the casts to float8_e4m3 (forward) / e5m2 (grads) and the
scaled GEMMs in forward and both backward products are torchao's `matmul_with_hp_or_float8_args`, the op its
`Float8Linear` (and so torchtitan's FP8 path) calls. megaframe's own linears keep their tensor-parallel
communication, so the swap is of the GEMM, not of the module: `enable_fp8` gives each block linear an
`Fp8Gemm`, and the linear calls it instead of `F.linear` on its local shards.

What stays bf16 (as in torchtitan and Megatron): the embedding, the output head (and the fused head + CE),
the MoE router and experts, norms and attention's softmax. Parameters stay bf16 with fp32 master weights in
the optimizer, so an FP8 checkpoint is a bf16 checkpoint: either precision resumes the other.

Scales are per local shard: under tp a tensorwise scale is the amax of this rank's slice, not of the whole
matrix (torchao's DTensor path would all-reduce the amax; without it a tp layout differs from one process by
fp8 rounding, within the loss bound the tests hold, not bit-exactly). Rowwise scales of the weight are per
output row and so layout-free for column-parallel layers.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from megaframe.errors import ConfigError


def _torchao():
    try:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
    except ImportError as e:
        raise ConfigError(f"train.precision=fp8 needs torchao (pip install torchao): {e}") from e
    return Float8LinearConfig, matmul_with_hp_or_float8_args, LinearMMConfig, ScaledMMConfig


class Fp8Gemm:
    """y_NO = x_NI @ w_OI^T with torchao's float8 scaled GEMMs (forward, grad input, grad weight)."""

    def __init__(self, recipe: str):
        config_cls, self._mm, mm_config, scaled = _torchao()
        self.recipe = str(getattr(recipe, "value", recipe))  # torchao tests type(name) == str: no StrEnum
        self.config = config_cls.from_recipe_name(self.recipe)
        c = self.config
        # The three GEMMs' settings as Float8Linear builds them (fast accumulation where the recipe says).
        self.mm_config = mm_config(*(scaled(c.emulate, g.use_fast_accum, False, c.pad_inner_dim) for g in (
            c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)))

    def __call__(self, x: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
        # torchao's matmul takes 2-d operands; the scaled GEMM wants dims that are multiples of 16
        x_NI = x.reshape(-1, x.shape[-1])
        y_NO = self._mm.apply(x_NI, w_OI.t(), self.mm_config, self.config)
        return y_NO.reshape(*x.shape[:-1], w_OI.shape[0])

    def __repr__(self) -> str:
        return f"Fp8Gemm({self.recipe})"


def enable_fp8(model: nn.Module, recipe: str, warn: bool = True) -> int:
    """Give every linear inside the transformer blocks an Fp8Gemm (the head, embedding and MoE stay bf16);
    returns how many linears were switched. A float8 GEMM needs both dims of the local weight a multiple of
    16: a linear that has not keeps its bf16 GEMM, named in one warning line (`warn`: this rank prints it)."""
    from megaframe.layers.linear import ColumnParallelLinear, RowParallelLinear

    gemm, n, kept = Fp8Gemm(recipe), 0, []
    for chunk in _blocks(model):
        for name, mod in chunk.named_modules():
            if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
                o, i = mod.weight.shape
                if o % 16 or i % 16:
                    kept.append(f"{name} [{o}, {i}]")
                    continue
                mod.gemm, n = gemm, n + 1
    if kept and warn:
        print(f"megaframe: warning: train.precision=fp8: {len(kept)} " "linear(s) kept in bf16, a local weight dim not "
              f"a multiple of 16 (float8 GEMM's rule): {', '.join(kept)}", file=sys.stderr, flush=True)
    return n


def _blocks(model: nn.Module):
    # a pipeline stage's model chunks (vpp) or one model: each keeps its blocks in .layers
    for mod in model.modules():
        layers = getattr(mod, "layers", None)
        if isinstance(layers, nn.ModuleDict):
            yield layers
