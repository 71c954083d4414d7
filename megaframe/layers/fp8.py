"""FP8 GEMMs for the blocks' linears (`train.precision=fp8`), through torchao's float8 training.

Legend: N tokens (flattened sequence x batch), I input features, O output features.

The scaling (dynamic, tensorwise or rowwise: torchao's recipes by name), the casts to float8_e4m3 (forward)
/ e5m2 (grads) and the scaled GEMMs of forward and grad-input are torchao's, as in its
`matmul_with_hp_or_float8_args` (the op its `Float8Linear`, and so torchtitan's FP8 path, calls), with each
operand cast once per micro-batch where the recipe's casts agree; the weight grad is the high-precision GEMM
into the fp32 main_grad, as a bf16 linear's (`_Fp8Linear`; torchao's rowwise_with_gw_hp keeps it high
precision too). megaframe's own linears keep their tensor-parallel communication, so the swap is of the
GEMM, not of the module: `enable_fp8` gives each block linear an `Fp8Gemm`, and the linear calls it instead
of `F.linear` on its local shards.

The output head's logits GEMM and its two backward GEMMs run float8 too under `train.fp8_head` (off by
default, as torchtitan and Megatron keep the head bf16):
inside the fused head + CE's chunks (layers/fused_ce.py, tp = 1) through `HeadGemms`, which makes the same
casts as torchao's matmul (the weight's cast once per call, hoisted out of the chunk loop; padded inner dims,
so a chunk of any token count is a valid float8 GEMM), and under tp through the head's `Fp8Gemm` (its own
ColumnParallelLinear, or the tied embedding's logits in layers/vocab.py:parallel_logits).
Under optim.zero=3 (tensorwise) a float8 linear's weight arrives already float8, gathered at 1 byte per
element with its scale (optim/float8_gather.py), and the GEMMs take it as is (`gathered_weight_t`).
What stays bf16 (as in torchtitan and Megatron): the embedding lookup, the MoE router and experts, norms
and attention's softmax. Parameters stay bf16 with fp32 master weights in
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
from megaframe.layers import wgrad
from megaframe.pipeline.split import wanted


def _torchao():
    try:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
    except ImportError as e:
        raise ConfigError(f"train.precision=fp8 needs torchao (pip install torchao): {e}") from e
    return Float8LinearConfig, matmul_with_hp_or_float8_args, LinearMMConfig, ScaledMMConfig


class _GatheredWeight(torch.autograd.Function):
    """The gathered float8 weight (data_OI, scale) as the Float8TrainingTensor w^T torchao's matmul takes; its
    grad goes to the bf16 parameter w_OI (whose storage may be freed: only its shape is used)."""

    @staticmethod
    def forward(ctx, w_OI, data_OI, scale, mm_config):
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        return Float8TrainingTensor(data_OI.t(), scale, w_OI.dtype, mm_config, GemmInputRole.WEIGHT)

    @staticmethod
    def backward(ctx, g_IO):
        return g_IO.t(), None, None, None


def gathered_weight_t(w_OI: torch.Tensor, mm_config) -> torch.Tensor | None:
    """w_OI^T as a float8 tensor when ZeRO-3 gathered it as float8 (`float8_gathered`), else None."""
    pre = getattr(w_OI, "float8_gathered", None)
    if pre is None:
        return None
    return _GatheredWeight.apply(w_OI, pre[0], pre[1], mm_config)


class Fp8Gemm:
    """y_NO = x_NI @ w_OI^T with torchao's float8 scaled GEMMs (forward, grad input, grad weight)."""

    def __init__(self, recipe: str, pad_inner_dim: bool = False):
        config_cls, self._mm, mm_config, scaled = _torchao()
        self.recipe = str(getattr(recipe, "value", recipe))  # torchao tests type(name) == str: no StrEnum
        self.config = config_cls.from_recipe_name(self.recipe)
        c = self.config
        # The three GEMMs' settings as Float8Linear builds them (fast accumulation where the recipe says);
        # `pad_inner_dim`: the head's, whose grad-weight GEMM has the token count (any) as inner dim
        pad = c.pad_inner_dim or pad_inner_dim
        self.mm_config = mm_config(
            *(
                scaled(c.emulate, g.use_fast_accum, False, pad)
                for g in (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)
            )
        )

    def __call__(self, x: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
        # torchao's matmul takes 2-d operands; the scaled GEMM wants dims that are multiples of 16
        x_NI = x.reshape(-1, x.shape[-1])
        # ZeRO-3 gathered it as float8 (optim/float8_gather.py)
        w_IO = gathered_weight_t(w_OI, self.mm_config)
        w_IO = w_OI.t() if w_IO is None else w_IO
        main = wgrad.fused_target(w_OI) if torch.is_grad_enabled() and w_OI.requires_grad else None
        y_NO = _Fp8Linear.apply(x_NI, w_IO, main, self)
        return y_NO.reshape(*x.shape[:-1], w_OI.shape[0])

    def same_cast(self, a: str, b: str) -> bool:
        """Whether the config's cast_config_<a> and cast_config_<b> make the same float8 tensor of one
        operand (tensorwise: one scale whatever the GEMM), so one cast serves both GEMMs."""
        from torchao.float8.config import ScalingGranularity

        ca, cb = getattr(self.config, f"cast_config_{a}"), getattr(self.config, f"cast_config_{b}")
        return ca == cb and ca.scaling_granularity is ScalingGranularity.TENSORWISE

    def cast(self, t: torch.Tensor, cast_config, role: str, dim: int) -> torch.Tensor:
        """t as torchao's matmul casts a GEMM operand (`cast_config`: one of the config's cast_config_*;
        `dim`: the axis a rowwise scale reduces over); t itself where the recipe keeps it high-precision."""
        from torchao.float8.config import ScalingType
        from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import GemmInputRole

        if cast_config.scaling_type is ScalingType.DISABLED:
            return t
        return hp_tensor_to_float8_dynamic(
            t,
            cast_config.target_dtype,
            self.mm_config,
            gemm_input_role=GemmInputRole[role],
            scaling_granularity=cast_config.scaling_granularity,
            axiswise_dim=get_maybe_axiswise_dim(dim, cast_config.scaling_granularity),
            round_scales_to_power_of_2=self.config.round_scales_to_power_of_2,
        )

    def __repr__(self) -> str:
        return f"Fp8Gemm({self.recipe})"


def _is_float8(t: torch.Tensor) -> bool:
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8

    return tensor_already_casted_to_fp8(t)


class _Fp8Linear(torch.autograd.Function):
    """y_NO = x_NI @ w_IO as torchao's matmul computes it (float8 forward and grad-input GEMMs), except:
    - each operand is cast once per micro-batch where the recipe's casts agree (tensorwise: the weight's
      float8 tensor of the forward serves the grad-input GEMM; torchao casts it again in backward);
    - the weight grad is the high-precision GEMM (torchao's rowwise_with_gw_hp idea) written or accumulated
      straight into the fp32 main_grad like a bf16 linear's (layers/wgrad.py: 4 / 8 B per parameter per
      micro-batch, not a bf16 grad plus the hook's add: 12 / 16), so grad x and the weight grad need one
      cast of the output grad, not two."""

    @staticmethod
    def forward(ctx, x_NI, w_IO, main_OI, gemm):
        c = gemm.config
        w8_IO = w_IO if _is_float8(w_IO) else gemm.cast(w_IO, c.cast_config_weight, "WEIGHT", 0)
        reuse = _is_float8(w_IO) or gemm.same_cast("weight", "weight_for_grad_input")
        ctx.gemm, ctx.reuse = gemm, reuse
        # on ctx, not saved: other micro-batches' backwards write main between this forward and its backward
        ctx.main = main_OI
        ctx.save_for_backward(x_NI, w_IO, w8_IO if reuse else None)
        return torch.mm(gemm.cast(x_NI, c.cast_config_input, "INPUT", -1), w8_IO)

    @staticmethod
    def backward(ctx, g_NO):
        x_NI, w_IO, w8_IO = ctx.saved_tensors
        gemm, c = ctx.gemm, ctx.gemm.config
        # a split backward (zero-bubble) asks for grad x (B) and the weight's (W) in two passes; a compiled
        # backward is traced once and wants both
        whole = torch.compiler.is_compiling()
        gx = gw = None
        if ctx.needs_input_grad[0] and (whole or wanted(x_NI)):
            if not ctx.reuse:
                w8_IO = gemm.cast(w_IO, c.cast_config_weight_for_grad_input, "WEIGHT", -1)
            gx = torch.mm(gemm.cast(g_NO, c.cast_config_grad_output, "GRAD_OUTPUT", -1), w8_IO.t())
        if ctx.needs_input_grad[1] and (whole or wanted(w_IO)):
            if ctx.main is None:
                gw = (g_NO.t() @ x_NI).t()
            else:
                wgrad.wgrad_into_main(ctx.main, g_NO, x_NI)
                gw = torch.empty_like(w_IO)  # fires the param's hook; never read (the hook drops it)
        return gx, gw, None, None


class HeadGemms:
    """The fused head + CE's three GEMMs per token chunk (layers/fused_ce.py) as float8 ones, cast as
    torchao's matmul casts them (float8_linear.py: matmul_with_hp_or_float8_args), the weight once per call:
        logits_CV = x_CD @ w_VD^T     grad_x_CD = g_CV @ w_VD     grad_w_VD = g_CV^T @ x_CD
    Where the recipe's two casts of an operand agree (tensorwise) the chunk's x and its logits' grad are
    cast once and serve both GEMMs that take them (torchao casts each twice).
    Inner dims are padded (ScaledMMConfig.pad_inner_dim): the grad-weight GEMM's is the chunk's tokens."""

    def __init__(self, gemm: Fp8Gemm, w_VD: torch.Tensor):
        self.gemm, c = gemm, gemm.config
        self.x8 = self.g8 = None  # this chunk's float8 x and logits' grad, where one cast serves two GEMMs
        # w^T as torchao's matmul gets it (Float8Linear passes weight.t()): forward and grad-input casts; one
        # tensorwise float8 weight where ZeRO-3 gathered it so (optim/float8_gather.py)
        self.w_DV = self.w_gi_DV = gathered_weight_t(w_VD, gemm.mm_config)
        if self.w_DV is None:
            self.w_DV = self.w_gi_DV = gemm.cast(w_VD.t(), c.cast_config_weight, "WEIGHT", 0)
            if not gemm.same_cast("weight", "weight_for_grad_input"):
                self.w_gi_DV = gemm.cast(w_VD.t(), c.cast_config_weight_for_grad_input, "WEIGHT", -1)

    def logits(self, x_CD: torch.Tensor) -> torch.Tensor:
        x8_CD = self.gemm.cast(x_CD, self.gemm.config.cast_config_input, "INPUT", -1)
        self.x8 = x8_CD if self.gemm.same_cast("input", "input_for_grad_weight") else None
        return torch.mm(x8_CD, self.w_DV)

    def grad_input(self, g_CV: torch.Tensor) -> torch.Tensor:
        g8_CV = self.gemm.cast(g_CV, self.gemm.config.cast_config_grad_output, "GRAD_OUTPUT", -1)
        self.g8 = g8_CV if self.gemm.same_cast("grad_output", "grad_output_for_grad_weight") else None
        return torch.mm(g8_CV, self.w_gi_DV.t())

    def grad_weight(self, g_CV: torch.Tensor, x_CD: torch.Tensor) -> torch.Tensor:
        c = self.gemm.config
        g8_CV, x8_CD, self.g8, self.x8 = self.g8, self.x8, None, None
        if g8_CV is None:
            g8_CV = self.gemm.cast(g_CV, c.cast_config_grad_output_for_grad_weight, "GRAD_OUTPUT", 0)
        if x8_CD is None:
            x8_CD = self.gemm.cast(x_CD, c.cast_config_input_for_grad_weight, "INPUT", 0)
        return torch.mm(g8_CV.t(), x8_CD)


def enable_fp8(model: nn.Module, recipe: str, warn: bool = True, head: bool = True) -> int:
    """Give every linear inside the transformer blocks an Fp8Gemm, and the output head one (`head`: the
    fused head + CE's chunks, or the tp head's GEMM); the embedding lookup and MoE stay bf16. Returns how
    many linears were switched. A float8 GEMM needs both dims of the local weight a multiple of 16: a
    linear that has not keeps its bf16 GEMM, named in one warning line (`warn`: this rank prints it)."""
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
    for gpt in (m for m in model.modules() if head and getattr(m, "output_step", None) is not None):
        v, d = gpt.head_weight().shape
        if v % 16 or d % 16:
            kept.append(f"head [{v}, {d}]")
            continue
        gpt.head_gemm, n = Fp8Gemm(recipe, pad_inner_dim=True), n + 1
        # tp > 1 or logits: the linear's GEMM
        if isinstance(getattr(gpt, "head", None), ColumnParallelLinear):
            gpt.head.gemm = gpt.head_gemm
    if kept and warn:
        print(
            f"megaframe: warning: train.precision=fp8: {len(kept)} linear(s) kept in bf16, a local weight "
            f"dim not a multiple of 16 (float8 GEMM's rule): {', '.join(kept)}",
            file=sys.stderr,
            flush=True,
        )
    return n


def float8_gathered_weights(model: nn.Module, precision: str, recipe: str, head: bool) -> list[nn.Parameter]:
    """The weights ZeRO-3 gathers as float8 in such a run (optim/float8_gather.py): those enable_fp8 gives a
    tensorwise Fp8Gemm (block linears whose local dims are multiples of 16, an untied head that fits).
    From shapes alone, so the planner's meta model (which keeps bf16 GEMMs) is sized like the run."""
    from megaframe.layers.linear import ColumnParallelLinear, RowParallelLinear

    if (
        str(getattr(precision, "value", precision)) != "fp8"
        or str(getattr(recipe, "value", recipe)) != "tensorwise"
    ):
        return []
    linears = [
        m
        for chunk in _blocks(model)
        for m in chunk.modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    ]
    heads = [
        m.head
        for m in model.modules()
        if head
        and getattr(m, "output_step", None) is not None
        and isinstance(getattr(m, "head", None), ColumnParallelLinear)
    ]
    return [m.weight for m in linears + heads if not (m.weight.shape[0] % 16 or m.weight.shape[1] % 16)]


def _blocks(model: nn.Module):
    # a pipeline stage's model chunks (vpp) or one model: each keeps its blocks in .layers, and the last
    # stage its multi-token-prediction depths (blocks too) in .mtp
    for mod in model.modules():
        for name in ("layers", "mtp"):
            blocks = getattr(mod, name, None)
            if isinstance(blocks, nn.ModuleDict):
                yield blocks
