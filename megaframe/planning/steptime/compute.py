"""The step-time model's compute: seconds a rank spends computing one step, by kind of work.

Per micro-batch token of a rank (tokens = micro-batch x S / cp), for each of its blocks:
  GEMMs       QKV, attention output, MLP up (gate fused) and down on this rank's [tokens, k] x [k, n / tp]
              (`gemm_dims`); forward once, backward twice (input and weight grads, each the forward's
              size). Each timed on a roofline with an efficiency curve over size (devices.py):
              max(FLOPs / (peak x curve(FLOPs)), bytes moved / (HBM x hbm_eff)), curve(f) = efficiency x
              f / (f + efficiency x peak x gemm_fixed_s) (the fixed time of a launch and the tail wave).
              Under train.precision=fp8 the block GEMMs run at the fp8 peak with 1-byte operands, plus
              their scaling work: an amax read and an fp8 cast write of each bf16 operand (the head's GEMM
              is float8 too under train.fp8_head where its dims allow; the norms and the attention core stay
              bf16, as layers/fp8.py leaves them). MoE experts: the
              rank's routed tokens (top_k of them) over its experts' GEMMs.
  attention   the causal core (QK^T and PV) of the rank's tokens against the sequence's keys
              (attention_flops) at the device's fused-attention rate (attn_eff of the bf16 peak). Under cp
              the rank's S/cp tokens already carry the split: parallel/context.py's load-balanced cut (rank
              r keeps chunks r and 2c-1-r) gives every rank exactly 1/cp of the causal square.
  elementwise norms, residual adds, dropout, RoPE and the MLP's activation: bytes each reads and writes
              over HBM x hbm_eff, forward + backward (about twice the forward). Under sp the [S, D] ones
              run on S/tp tokens; without it every tp rank repeats them.
  head        the head GEMM (bf16) and the fused cross-entropy's passes over the logits (per token V/tp:
              bf16 logits written and read, fp32 softmax and its gradient).
Recompute re-runs what it dropped: full, every block's forward (a third of GEMMs, attention and
elementwise); selective, the attention core's forward; op_selective, the elementwise ops and every
second matmul of a block (rerun_gemm_share), not the attention core.
"""

from __future__ import annotations

import functools

from megaframe.planning.candidate import cp_ring
from megaframe.planning.devices import Device
from megaframe.planning.steptime.launches import copies_v
from megaframe.planning.steptime.moe import (
    experts_seconds,
    grouped_kernel,
    padded_bytes,
    permute_rows,
    router_bytes,
    swiglu_bytes,
)
from megaframe.training.metrics import flops_per_token

PASSES = 3
"""Forward + backward as multiples of the forward (backward: input and weight grads)."""
EAGER_TRAFFIC = 3.0
"""HBM traffic of the elementwise work in eager mode (train.compile=false) over the fused kernels' one
read and one write per op: eager RMSNorm alone upcasts to fp32 and makes four passes (pow, mean, rsqrt
multiply, weight multiply: ~22 bytes an element against 4), SiLU-and-multiply three kernels, RoPE's
complex fp32 rotation five; averaged over a block's ops, about 3x. torch.compile fuses them back to one."""


def gemm_dims(m, tp: int) -> tuple[tuple[int, int], ...]:
    """(k, n) on one rank of a block's GEMMs: QKV, the attention output, the MLP's up (gate fused) and
    down projections; column-parallel ones split n over tp, row-parallel ones k."""
    d, e, h = m.hidden_size, m.head_dim, m.num_attention_heads
    ffn = m.expert_ffn if m.num_experts else m.ffn_hidden_size
    up = (2 if str(getattr(m.activation, "value", m.activation)) == "swiglu" else 1) * ffn
    return ((d, (h + 2 * m.kv_heads) * e // tp), (h * e // tp, d), (d, up // tp), (ffn // tp, d))


@functools.lru_cache(maxsize=None)
def gemm_seconds(dev: Device, precision: str, tokens: int, k: int, n: int, fixed: float = 1.0) -> float:
    """One forward GEMM [tokens, k] x [k, n] on the roofline with the size curve (module doc); `fixed`
    scales the device's fixed time (a grouped GEMM's group: moe.GROUPED_FIXED)."""
    peak = dev.peak(precision)
    elem = {"fp8": 1, "bf16": 2}.get(precision, 4)
    flops = 2.0 * tokens * k * n
    if not dev.hbm_bw:  # no per-shape model (the cpu): the measured rate at `efficiency`
        return flops / (peak * dev.efficiency)
    rate = peak * dev.efficiency * flops / (flops + dev.efficiency * peak * dev.gemm_fixed_s * fixed)
    memory = elem * (tokens * k + k * n) + 2 * tokens * n  # fp8 GEMMs write bf16 outputs
    return max(flops / rate, memory / (dev.hbm_bw * dev.hbm_eff))


def gemm_efficiency(dev: Device, precision: str, tokens: int, gemms: tuple) -> float:
    """Fraction of peak the GEMMs (k, n) over `tokens` rows reach together, FLOP-weighted."""
    flops = sum(2.0 * tokens * k * n for k, n in gemms)
    return flops / (dev.peak(precision) * sum(gemm_seconds(dev, precision, tokens, k, n) for k, n in gemms))


def _stream(dev: Device, nbytes: float) -> float:
    """Seconds to stream nbytes through HBM (0 on the cpu: its rate already folds them in)."""
    return nbytes / (dev.hbm_bw * dev.hbm_eff) if dev.hbm_bw else 0.0


def block_seconds(
    cfg, dev: Device, tp: int, cp: int, micro_batch: int, sp: bool, ep: int = 1
) -> dict[str, float]:
    """Seconds of one block's forward + backward for one micro-batch on one rank, by kind (module doc)."""
    m, prec = cfg.model, cfg.train.precision
    prec = str(getattr(prec, "value", prec))
    tokens = micro_batch * m.seq_length // cp
    gemm_prec = "fp8" if prec == "fp8" else prec
    dims = gemm_dims(m, tp)
    router = 0.0
    if m.num_experts:  # attention's GEMMs, then the rank's experts as grouped GEMMs (planning.steptime.moe)
        gemm = sum(gemm_seconds(dev, gemm_prec, tokens, k, n) for k, n in dims[:2])
        # the experts stay bf16 under fp8 (layers/fp8.py converts nn.Linear only)
        ex_prec = "bf16" if gemm_prec == "fp8" else gemm_prec
        routed = tokens // (tp if sp else 1)  # under sp each tp rank routes its own block
        gemm += experts_seconds(gemm_seconds, dev, ex_prec, m, routed, 1, ep)
        # the router's GEMM runs in fp32 whatever the precision (router.py: x.float(), an fp32 weight), on
        # the CUDA cores: megaframe leaves torch's float32 matmul precision at "highest" (no TF32)
        gemm += gemm_seconds(dev, "fp32_cores", routed, m.hidden_size, m.num_experts)
        router = _stream(dev, moe_bytes(m, dev, ex_prec, routed, ep))
        dims = dims[:2]
    else:
        gemm = sum(gemm_seconds(dev, gemm_prec, tokens, k, n) for k, n in dims)
    act = 4 if prec == "fp32" else 2
    scale = 0.0
    if prec == "fp8":  # amax read + fp8 write of each bf16 operand, forward and the backward's grad operand
        scale = _stream(dev, sum(3 * act * (tokens * k + k * n) for k, n in dims))
    # the experts' activation is counted with the rest of the MoE layer's passes (moe_bytes)
    d, ffn = m.hidden_size, (0 if m.num_experts else m.ffn_hidden_size)
    per_tok = (4 + 6 + (5 if m.dropout > 0 else 0)) * d / (tp if sp else 1)  # norms, residuals, dropout
    per_tok += (3 if "swiglu" in str(m.activation) else 2) * ffn / tp
    if "rope" in str(m.position_embedding):
        per_tok += 2 * (m.num_attention_heads + m.kv_heads) * m.head_dim / tp
        if copies_v(m, cp > 1 and not cp_ring(cfg)):  # v copied out of the [q | k | v] output
            per_tok += 2 * m.kv_heads * m.head_dim / tp
    attn = attention_flops(m, tokens, tp, cp)
    attn_rate = dev.peak("bf16" if prec != "fp32" else prec) * (
        dev.attn_eff if dev.hbm_bw else dev.efficiency
    )
    eager = 1.0 if cfg.train.compile else EAGER_TRAFFIC
    elementwise = PASSES * eager * _stream(dev, tokens * per_tok * act)
    return {"gemm": PASSES * gemm + scale, "attention": attn / attn_rate, "elementwise": elementwise + router}


def moe_bytes(m, dev: Device, prec: str, routed: int, ep: int) -> float:
    """HBM bytes of an MoE layer's router, permutation, experts' SwiGLU and (without a grouped kernel)
    padding passes for one micro-batch, forward + backward (planning.steptime.moe: each counted from the
    trainer's code)."""
    elem = 4 if prec == "fp32" else 2
    out = router_bytes(m, routed, elem) + permute_rows(m, routed, ep) * m.hidden_size * elem
    out += swiglu_bytes(m, routed, ep, elem)
    return out + (0.0 if grouped_kernel(dev, prec) else padded_bytes(m, routed, ep, elem))


def attention_flops(m, tokens: int, tp: int, cp: int) -> float:
    """FLOPs of the attention core (QK^T and PV, forward + backward: 12 x S x H x E per query token) of
    `tokens` query tokens of one rank against the whole sequence's keys, its H/tp heads. Exact causal
    kernels skip the masked half, on average S/2 keys a token: without cp the causal kernel, under cp
    parallel/cp_attention.py's per-chunk calls and ring_fused.py's visible chunk pairs. Under cp with
    attention dropout both cp paths compute the whole [S/cp, S] square under a mask (model/attention.py:
    SDPA with the explicit bias; the ring's masked math, timed at the fused rate though it runs in fp32
    matmuls: not modelled): twice the causal work. `tokens` is the rank's
    (S/cp a sequence), so no further division by cp: the balanced cut gives each rank 1/cp of the
    square (module doc)."""
    full_square = cp > 1 and m.dropout > 0
    return tokens * 12 * m.seq_length * m.num_attention_heads * m.head_dim / tp / (1 if full_square else 2)


def head_seconds(cfg, dev: Device, tp: int, cp: int, micro_batch: int) -> float:
    """The head GEMM (float8 under fp8 with train.fp8_head where its local dims are multiples of 16, as
    layers/fp8.py enables it; else bf16) and the fused cross-entropy over one micro-batch's logits."""
    m, prec = cfg.model, str(getattr(cfg.train.precision, "value", cfg.train.precision))
    tokens = micro_batch * m.seq_length // cp
    fits = cfg.train.fp8_head and (m.vocab_size // tp) % 16 == 0 and m.hidden_size % 16 == 0
    hp = "bf16" if prec == "fp8" and not fits else prec
    act = 4 if prec == "fp32" else 2
    return PASSES * gemm_seconds(dev, hp, tokens, m.hidden_size, m.vocab_size // tp) + _stream(
        dev, tokens * m.vocab_size / tp * (2 * act + 8)
    )


def step_compute(cfg, dev: Device, lay, layers: int, micro: int, head: bool) -> dict[str, float]:
    """Seconds of a rank's step by kind: `layers` blocks (its pipeline stage's) for `micro` micro-batches,
    the head when it holds it; recompute's re-run forward added to each kind it repeats."""
    sp = lay.tp > 1 and lay.sp
    b = block_seconds(cfg, dev, lay.tp, lay.cp, lay.micro_batch, sp, lay.ep)
    rerun = {
        "none": (0.0, 0.0, 0.0),
        "selective": (0.0, 1 / 3, 0.0),
        "full": (1 / 3, 1 / 3, 1 / 3),
        "op_selective": (rerun_gemm_share(cfg.model) / 3, 0.0, 1 / 3),
    }[lay.recompute]
    out = {k: layers * micro * v * (1 + r) for (k, v), r in zip(b.items(), rerun)}
    out["head"] = micro * head_seconds(cfg, dev, lay.tp, lay.cp, lay.micro_batch) if head else 0.0
    return out


def model_flops(cfg) -> float:
    """Model FLOPs per token the MFU is quoted in (training.metrics: non-causal attention, no recompute,
    as Megatron and torchtitan count them)."""
    return flops_per_token(cfg.model)


def rerun_gemm_share(m) -> float:
    """Share of a block's forward matmul FLOPs op_selective re-runs in backward (model/recompute.py: every
    second matmul in forward order). A dense block runs [q|k|v], out, [gate|up] (or up), down: the 2nd
    and 4th, out and down, are re-run. An MoE block's matmuls alternate over its experts' calls: half."""
    if m.num_experts:
        return 0.5
    d, f, kv = m.hidden_size, m.ffn_hidden_size, m.kv_heads * m.head_dim
    up = 2 * f if m.activation == "swiglu" else f
    return (d * d + f * d) / (d * (d + 2 * kv) + d * d + d * up + f * d)
