"""The step-time model's fixed per-call costs (planning.steptime.timing): kernel launches and MoE host syncs.

launch   every kernel the trainer runs is issued by the host: PyTorch's eager dispatch and the CUDA launch
         cost LAUNCH_S of CPU time each. The host runs ahead of the GPU (launches are asynchronous), so a
         stretch of work costs max(kernels x LAUNCH_S, its GPU seconds): the launches are hidden where the
         GPU's work per kernel exceeds their issue time and are the step where it does not (small models,
         few tokens a rank: what dominates small models at large dp). Charged per block and micro-batch
         (the blocks are alike, so this is the whole step's max too) as the excess over the block's GPU
         seconds, and for the head per micro-batch. The kernels are counted from the block's structure
         (`block_kernels`), forward + backward, including the tp collectives each block issues.
moe sync the dispatcher reads the split sizes on the host once per MoE layer and micro-batch forward
         (model/moe/dispatcher.py: `.tolist()`, a device sync; again in a re-run forward): the host waits
         for the GPU to drain, so the queue is empty and the GPU idles for the sync's round trip and the
         next launch (SYNC_S + LAUNCH_S) however large the work; plus the counts' own all-to-all over the
         expert group before it, and their gathers under sp / cp / etp (small messages: their latency).

LAUNCH_S = 5 us, SYNC_S = 6 us, both sourced, not fitted: NVIDIA's "Getting Started with CUDA Graphs"
(A. Gray, NVIDIA Developer Blog, 2019) times a stream of short kernels at 3.8 us each when launch-bound
without syncs and 9.6 us with a stream sync after each (the sync's round trip ~6 us); PyTorch's "Accelerating
PyTorch with CUDA Graphs" (PyTorch blog, 2021) reports eager ops' CPU launch overhead of several
microseconds an op, which is why it is not hidden for small per-op work. 5 us sits in the 4-10 us those give
for an eager op (the framework's dispatch on top of the bare launch). One pair for every GPU (host-bound,
not device-bound); the cpu has no launch queue (its measured rate holds the overheads): 0.
"""

from __future__ import annotations

LAUNCH_S = 5e-6
"""Host seconds to issue one kernel from eager PyTorch (module doc: sourced)."""
SYNC_S = 6e-6
"""A device-to-host sync's round trip beyond the launch (module doc: sourced)."""


def _act(m) -> str:
    return str(getattr(m.activation, "value", m.activation))


def copies_v(m, cp_gathered: bool = False) -> bool:
    """Whether attention copies v out of the [q | k | v] output before attending (model/attention.py:
    Attention.owns_v): q and k rotated by RoPE, no q/k norm keeping views of the output, and no cp
    all-gather making a new V anyway. One kernel a block forward, and its bytes (compute.block_seconds)."""
    rope = "rope" in str(m.position_embedding)
    return rope and not getattr(m, "qk_norm", False) and not cp_gathered


def block_kernels(
    m, compiled: bool, tp_colls: int, rerun: bool = False, ep: int = 1, cp_gathered: bool = False
) -> int:
    """Kernels one block issues for one micro-batch, forward + backward, on a GPU (module doc).

    Forward, eager: 2 norms (fused RMSNorm / LayerNorm, 1 each), 4 GEMMs (fused [q|k|v], out-proj, MLP up
    with the gate fused, down), the attention core (1 fused kernel), RoPE on q and k (apply_rope: neg, cat,
    two multiplies and an add, 5 each) and v's copy where q and k are its only other users (no q/k norm: 1),
    the activation (SwiGLU: silu and the multiply, 2; else 1), 2
    residual adds, dropout's mask and multiply at its 2 sites where dropout > 0. Backward: 2 GEMMs per
    forward GEMM (input and weight grads) and the weight grad's accumulation over micro-batches (an add per
    weight: 4 GEMM weights + 2 norm weights), the fused attention backward (3: the output-grad dot
    product, the main kernel, dq's conversion), each norm's backward (2: input grad, weight-grad
    reduction), RoPE's (as many as its forward), the activation's (SwiGLU: silu's backward, the product's
    two grads, the [gate|up] concatenation: 4; else 1), the residual branch points' grad adds (2), dropout's
    multiply (2). Compiled (train.compile=true): the elementwise ops fuse into one Triton kernel per region
    between GEMMs/attention (norm, RoPE with v's copy, activation, residual+norm: 4 forward, 4 backward),
    GEMMs, attention and the grad adds as eager. An MoE block: its experts' two grouped GEMMs in place of the
    MLP's four, its experts' weighted SwiGLU (eager, after the dispatcher's host sync) in place of the
    activation above, plus the router and dispatch kernels: all that `moe_kernels` counts. Plus
    `tp_colls` collective kernels. `cp_gathered`: parallel.cp > 1 over the all-gather (no copy of v).
    """
    swiglu = "swiglu" in _act(m)
    rope = 10 if "rope" in str(m.position_embedding) else 0
    v_copy = 1 if copies_v(m, cp_gathered) else 0
    drop = 2 if m.dropout > 0 else 0
    act_f, act_b = (2, 4) if swiglu else (1, 1)
    gemms = 2 if m.num_experts else 4  # an MoE block's MLP GEMMs are its experts' grouped ones
    weights = gemms + 2
    # an MoE block's experts run their own activation (moe_kernels), not the MLP's (nor its fused region)
    mlp_f, mlp_b = (0, 0) if m.num_experts else (act_f, act_b)
    if compiled:
        regions = 4 - (1 if m.num_experts else 0)
        fwd = gemms + 1 + regions
        bwd = 2 * gemms + weights + 3 + regions + 2
    else:
        fwd = 2 + gemms + 1 + rope + v_copy + mlp_f + 2 + 2 * drop
        bwd = 2 * gemms + weights + 3 + 4 + rope + mlp_b + 2 + drop
    if m.num_experts:
        # the router, dispatch, experts' activation and losses (moe_kernels); the shared expert's dense MLP
        f, b = moe_kernels(ep)
        fwd, bwd = fwd + f, bwd + b
        if getattr(m, "moe_shared_experts", 0):
            fwd, bwd = fwd + 2 + act_f, bwd + 4 + 2 + act_b
    return fwd * (2 if rerun else 1) + bwd + tp_colls


def moe_kernels(ep: int) -> tuple[int, int]:
    """(forward, backward) kernels of an MoE layer's router, dispatch, experts' activation and losses for
    one micro-batch, beyond its experts' grouped GEMMs and the rows' and weights' all-to-alls (counted by
    the caller), one per torch op of model/moe/ (a sort counted once; bf16 activations, so the weight's
    casts run), as the trainer runs them eagerly after the dispatcher's host sync breaks the compiled
    graph. Forward: the router (x and the weight cast to fp32, the GEMM: 3), route (softmax, top-k,
    gather, sum, clamp, divide: 6), the counts (zeros, ones, scatter_add: 3), plan (sort, zeros, the
    token index, the weights' gather: 4), dispatch_combine (cat, the host copy, the gather by token, the
    group ends' sum and cumsum, the ends' int cast, the combine's zeros and index_add: 8; under ep the
    counts' all-to-all, the regrouping's arange, repeat, repeat_interleave (2) and sort, its gathers of
    the rows and of the weights, its inverse's zeros and index_add: 10), the experts' weighted SwiGLU
    (silu, the product with up, the weight's cast and product: 4), the losses (the aux loss's 6 and its
    coefficient, the z term's zeros and add: 9) and the step statistics (18). Backward: the router's
    (dgrad, wgrad, the two casts' and the weight-grad add: 5), route's (softmax, the gather's zeros and
    scatter, the division's 4, the clamp's mask, the grads' add: 10), the aux loss's 5 and the injected
    seed 1, dispatch_combine's (the combine's index_select, the token gather's zeros, sort and index_put,
    the weights' slice (zeros, copy) and the plan's gather of them (zeros, sort, index_put), the two grads
    of x added: 10; under ep the inverse's index_select and the regrouping's two gathers' zeros, sort and
    index_put: 7), the weighted SwiGLU's (sigmoid, silu's product, dh·w with the weight's cast; the
    weight's grad: two products, the sum in fp32; the gate's grad: four products, 1 - sig, 1 + ...; the
    up grad's product and the concatenation: 15)."""
    under_ep = ep > 1
    forward = 3 + 6 + 3 + 4 + 8 + 10 * under_ep + 4 + 9 + 18
    backward = 5 + 10 + 6 + 10 + 7 * under_ep + 15
    return forward, backward


def head_kernels(compiled: bool) -> int:
    """Kernels of the final norm, the head GEMM and the fused cross-entropy for one micro-batch, forward
    + backward: norm 1 + 2, the head's GEMM 1 + 2 and its weight-grad add, the loss's chunked passes
    (max, exp-sum, target gather, the gradient: about 6 a chunk, one chunk counted), the embedding's
    gather and its backward scatter-add (2)."""
    return 3 + 4 + 6 + 2 - (2 if compiled else 0)


def exposed(kernels: int, gpu_seconds: float) -> float:
    """Seconds the GPU waits on the host to issue `kernels` covering gpu_seconds of work (module doc)."""
    return max(kernels * LAUNCH_S - gpu_seconds, 0.0)


def moe_sync_seconds(forwards: int) -> float:
    """The GPU's idle time at the dispatcher's host syncs: `forwards` MoE layer forwards (module doc)."""
    return forwards * (SYNC_S + LAUNCH_S)
