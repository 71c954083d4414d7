"""Float8 parameter all-gather under ZeRO-3 (optim.zero=3 with train.precision=fp8, tensorwise recipe).

The weights of the float8 linears (those with an Fp8Gemm: layers/fp8.py) are cast to float8 e4m3 on each
rank's shard *before* the all-gather, so the gather moves 1 byte per element instead of bf16's 2, and the
GEMM takes the gathered float8 weight with its scale as is: the bf16 weight of those linears is never
gathered in training (only by sync_params, for readers of whole params outside a forward).

What is taken from torchao (torchao/float8/fsdp_utils.py, FSDP2's float8 all-gather):
  - `precompute_float8_dynamic_scale_for_fsdp`: after the optimizer step, the scales of every float8 weight
    come from ONE all-reduce(max) of the stacked per-shard amaxes (`torch._foreach_norm(..., inf)`), not one
    per parameter; scale = fp8 max / amax as `float8_utils.amax_to_scale` computes it (float64 division,
    power-of-2 rounding where the recipe asks).
  - `WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`: the shard is cast with that precomputed scale
    (`hp_tensor_and_scale_to_float8`, saturated) and its raw float8 bytes are what is gathered;
    `fsdp_post_all_gather`: the gathered bytes plus the scale make a `Float8TrainingTensor` (role WEIGHT)
    that torchao's `matmul_with_hp_or_float8_args` uses unchanged in forward and for the grad input
    (it skips its own cast of an operand already in float8), while the weight grad is computed from the
    high-precision input and grad and reduce-scattered in the grad dtype as before.
What differs: FSDP2 gathers per parameter through tensor-subclass hooks; here a block's float8 weights get
a bucket of their own (`split_groups`), gathered as one flat uint8 tensor through comm.all_gather_flat
(byte-counted like every collective), into a storage that is freed and regathered like the bf16 buckets'
(optim/zero3.py), so the Float8TrainingTensor autograd saved for backward sees the regathered bytes.

The scale is the amax over the whole local (tp-sliced) parameter, the same one the unsharded fp8 path
computes from its bf16 weight, and the shard is cast from the fp32 master rounded to bf16 first (max|x| of
the rounded values is the rounded max|x|): the float8 weight is the one a dp = 1 run would use.
The scales are recomputed when the master may have changed (after each step, a load, a sync_params), at
the next float8 gather, on every rank alike: one all-reduce per step, no host sync.
The rowwise recipe casts the weight per row and differently for the grad-input GEMM: its weights are
gathered bf16 as before.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from megaframe.parallel import comm


def float8_weights(model: nn.Module) -> tuple[list[nn.Parameter], object]:
    """The weights whose GEMM is a tensorwise Fp8Gemm (block linears, an untied head), in model order, and
    that GEMM's torchao config (None without any)."""
    out, seen, config = [], set(), None
    for mod in model.modules():
        gemm, w = getattr(mod, "gemm", None), getattr(mod, "weight", None)
        if gemm is not None and getattr(gemm, "recipe", None) == "tensorwise" and isinstance(w, nn.Parameter):
            config = gemm.config
            if id(w) not in seen:
                seen.add(id(w))
                out.append(w)
    return out, config


def split_groups(groups: list[list], float8: set[int]) -> list[list]:
    """Each bucket group split in two where it mixes float8 weights with other params (norms, biases, bf16
    linears): the float8 ones in a bucket of their own, gathered as float8; the rest gathered as before."""
    out = []
    for g in groups:
        f8 = [p for p in g if id(p) in float8]
        rest = [p for p in g if id(p) not in float8]
        out += [x for x in (rest, f8) if x]
    return out


class Float8Gather:
    """The float8 weights of one ZeRO-3 optimizer: their scales, their buckets' float8 storage and casts."""

    def __init__(self, params: list[nn.Parameter], config, device):
        self.params = params
        self.index = {id(p): i for i, p in enumerate(params)}
        self.dtype = config.cast_config_weight.target_dtype
        self.round_pow2 = config.round_scales_to_power_of_2
        # written in place: the gathered weights' Float8TrainingTensors hold views of it
        self.scale = torch.ones(len(params), dtype=torch.float32, device=device)
        self.stale = True
        self._segs: dict[int, tuple[list, torch.Tensor]] = {}

    def holds(self, b) -> bool:
        return bool(b.params) and id(b.params[0]) in self.index

    def attach(self, b) -> None:
        """Give float8 bucket b its gathered uint8 storage (freed at once) and each param its float8 view."""
        b.f8 = torch.empty(b.numel, dtype=torch.uint8, device=b.pfull.device)
        o = 0
        for p in b.params:
            data = b.f8[o : o + p.numel()].view(self.dtype).view(p.shape)
            p.float8_gathered = (data, self.scale[self.index[id(p)]])
            o += p.numel()
        b.f8.untyped_storage().resize_(0)

    @torch.no_grad()
    def update_scales(self, buffers, states) -> None:
        """Scales of every float8 weight from the fp32 masters: each rank's shard amax (of the values rounded
        to the params' dtype), one all-reduce(max) per buffer axis, torchao's amax_to_scale."""
        from torchao.float8.float8_utils import amax_to_scale

        amax = torch.zeros(len(self.params), dtype=torch.float32, device=self.scale.device)
        for buf, st in zip(buffers, states):
            if not any(self.holds(b) for b in buf.buckets):
                continue
            segs, idx = self._segments(buf)
            if segs:
                views = [st.master[s.state_lo : s.state_lo + s.numel] for s in segs]
                norms = torch.stack(torch._foreach_norm(views, ord=math.inf)).to(buf.dtype).float()
                amax.scatter_reduce_(0, idx, norms, "amax")
            comm.all_reduce(amax, buf.axis, op=torch.distributed.ReduceOp.MAX)
        self.scale.copy_(amax_to_scale(amax, self.dtype, self.round_pow2))
        self.stale = False

    def _segments(self, buf) -> tuple[list, torch.Tensor]:
        """buf's segments of float8 weights on this rank, and their params' indices as a device tensor: made
        once (the layout is fixed), not copied to the device at every step."""
        if id(buf) not in self._segs:
            segs = [s for s in buf.segments if id(s.param) in self.index]
            idx = torch.tensor([self.index[id(s.param)] for s in segs], dtype=torch.long)
            self._segs[id(buf)] = (segs, idx.to(self.scale.device))
        return self._segs[id(buf)]

    @torch.no_grad()
    def cast_shard(self, buf, b, master_shard: torch.Tensor, mine8: torch.Tensor) -> None:
        """This rank's range of float8 bucket b: the master cast to the params' dtype, then to float8 with
        each param's scale (torchao's hp_tensor_and_scale_to_float8); padding zero."""
        from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8

        lo, n = b.shard_lo, master_shard.numel()
        out = mine8.view(self.dtype)
        out.zero_()
        for p in b.params:
            p_lo = buf.offset[p]
            s_lo, s_hi = max(lo, p_lo), min(lo + n, p_lo + p.numel())
            if s_lo < s_hi:
                hp = master_shard[s_lo - lo : s_hi - lo].to(buf.dtype)
                out[s_lo - lo : s_hi - lo] = hp_tensor_and_scale_to_float8(
                    hp, self.scale[self.index[id(p)]], self.dtype
                )._data
