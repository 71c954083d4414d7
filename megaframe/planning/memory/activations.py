"""Activation memory of one micro-batch: the bytes autograd saves for backward during a forward.

`saved_bytes(fn)` runs fn under `torch.autograd.graph.saved_tensors_hooks` and sums the storages the
graph keeps, each storage once (views of one tensor share it) and never a parameter's. It is the
same measurement on real tensors (tests, on CPU) and on the meta device (the planner), where shapes
and dtypes propagate without memory or compute.

One difference between devices needs care: on meta, `scaled_dot_product_attention` falls back to its
math decomposition, which saves the [B, H, S, S] attention matrix; the fused kernels every real
device runs (flash / memory-efficient on CUDA, flash on CPU) save only q, k, v, the output and the
row log-sum-exp [B, H, S] (fp32). `FusedAttentionSizes` swaps in a shape-only stand-in that saves
exactly those, so meta figures are what a real device keeps; RMSNorm likewise (the fused kernel's input
and per-row reciprocal RMS, not the composite's fp32 copies). The cp all-gather path without dropout
(parallel/cp_attention.py) calls the CPU flash kernel itself, which has meta shapes: it runs as is on
meta and saves what it saves on CPU (the same five tensors, no mask).

Under train.recompute=op_selective a block keeps what its policy keeps (model/recompute.py) besides its
input: `count_saved` counts those tensors too, and the stand-in reports its output and log-sum-exp as a
fused kernel's kept outputs.

`allocator_peak(fn)` is the measured counterpart on CPU: the peak of what the allocator hands out while
fn runs (saved tensors and transients alike), from the profiler's allocation events.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from megaframe.model.recompute import keep_in_region, saved_by_policy


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the StorageImpl: shared by every view of one allocation


class SavedBytes:
    """Collects the distinct non-parameter storages saved for backward while active."""

    def __init__(self, params: Iterable[torch.Tensor] = ()):
        self.exclude = {_storage_key(p) for p in params}
        self.storages: dict[int, int] = {}
        self._keep: list[torch.Tensor] = []  # keep storages alive: a freed key could be reused

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in self.exclude and key not in self.storages:
            self.storages[key] = t.untyped_storage().nbytes()
            self._keep.append(t)
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


@contextmanager
def count_saved(params: Iterable[torch.Tensor] = ()):
    """with count_saved(model.parameters()) as c: forward ...; then c.bytes."""
    counter = SavedBytes(params)
    # op_selective's kept outputs live in its policy's cache, not in autograd's saved tensors: counted too
    with saved_by_policy(counter), torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        yield counter  # only packing is measured


def saved_bytes(fn: Callable[[], object], params: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages saved for backward while fn() runs (parameters excluded)."""
    with count_saved(params) as c:
        out = fn()
    del out
    return c.bytes


class _FusedAttention(torch.autograd.Function):
    """Shape-only stand-in for a fused attention kernel: saves q, k, v, out and logsumexp_BHS, and for a
    bool mask the float copy the kernels make of it per call (a float mask is saved by reference: the cp
    bias shared by the layers, which the planner counts once per rank, not per micro-batch)."""

    @staticmethod
    def forward(ctx, q_BHSE, k_BKSE, v_BKSE, mask):
        out_BHSE = torch.empty_like(q_BHSE)
        lse_BHS = torch.empty(q_BHSE.shape[:-1], dtype=torch.float32, device=q_BHSE.device)
        keep_in_region(out_BHSE, lse_BHS)  # under op_selective a fused kernel's outputs are what is kept
        saved = [q_BHSE, k_BKSE, v_BKSE, out_BHSE, lse_BHS]
        if mask is not None and mask.dtype == torch.bool:
            saved.append(torch.empty(mask.shape, dtype=q_BHSE.dtype, device=mask.device))
        ctx.save_for_backward(*saved)
        return out_BHSE

    @staticmethod
    def backward(ctx, g):  # pragma: no cover - planning never runs backward
        raise RuntimeError("the planner's attention stand-in has no backward")


class _FusedRMSNorm(torch.autograd.Function):
    """Shape-only stand-in for the fused RMSNorm kernel a GPU runs (aten._fused_rms_norm, what F.rms_norm
    dispatches to on CUDA, and what a compiled block's partitioner keeps of the decomposition): it saves the
    input and the fp32 reciprocal RMS per row [..., 1]. The composite path meta and CPU run instead saves
    two fp32 copies of the input (the upcast and the normalised rows): 4x the input's bf16 bytes, which a
    real device never holds (405B at tp8: 192 MiB a layer a micro-batch)."""

    @staticmethod
    def forward(ctx, x, weight):
        rstd = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):  # pragma: no cover - planning never runs backward
        raise RuntimeError("the planner's rms_norm stand-in has no backward")


class _FusedSwiGLU(torch.autograd.Function):
    """Shape-only stand-in for silu(gate) * up inside a compiled block: inductor's partitioner keeps the
    inputs (gate and up, views of the [gate | up] projection output already saved) and recomputes the
    silu in backward, so the silu output (one [S, B, F] tensor a layer) is not held as eager holds it."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return torch.empty_like(up)

    @staticmethod
    def backward(ctx, g):  # pragma: no cover - planning never runs backward
        raise RuntimeError("the planner's swiglu stand-in has no backward")


class FusedAttentionSizes(TorchFunctionMode):
    """Inside this mode scaled_dot_product_attention and rms_norm save what a GPU's fused kernels save
    (see above; rms_norm only with `fused_norm`: a GPU's kernel or a compiled block, _FusedRMSNorm);
    `compiled` (train.compile's blocks) also fuses silu(gate) * up."""

    def __init__(self, compiled: bool = False, fused_norm: bool = False):
        super().__init__()
        self.compiled, self.fused_norm = compiled, fused_norm or compiled
        self._silu: dict[int, tuple] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.compiled and func is F.silu:
            # a placeholder outside autograd: the product below is what the compiled graph saves for
            out = torch.empty_like(args[0]).detach()
            self._silu[id(out)] = (out, args[0])
            return out
        if self.compiled and func in (torch.Tensor.mul, torch.mul) and id(args[0]) in self._silu:
            return _FusedSwiGLU.apply(self._silu.pop(id(args[0]))[1], args[1])
        if func is F.scaled_dot_product_attention:
            mask = (kwargs or {}).get("attn_mask", args[3] if len(args) > 3 else None)
            return _FusedAttention.apply(*args[:3], mask)  # scale, dropout, gqa change nothing saved
        if self.fused_norm and func is F.rms_norm:
            weight = (kwargs or {}).get("weight", args[2] if len(args) > 2 else None)
            return _FusedRMSNorm.apply(args[0], weight)
        return func(*args, **(kwargs or {}))


def chunk_activation_bytes(
    model,
    chunk: int,
    micro_batch: int,
    fused_attention: bool,
    compiled: bool = False,
    fused_norm: bool = False,
) -> int:
    """Bytes one micro-batch of `chunk` saves for backward on this rank (model: a megaframe GPT).

    The chunk's input is what the pipeline hands it: token ids on the first stage, else a hidden-state
    tensor [S (S/tp under sp), B, D] in the parameters' dtype that requires grad (a received activation).
    Under context parallelism S is this cp rank's S/cp tokens, and attention runs over the cp axis as in
    training (the gathered K/V, or the ring's blocks), on a virtual axis without communicating.
    `compiled`: the blocks run compiled (train.compile): their SwiGLU keeps its inputs, not the silu output;
    `fused_norm`: RMSNorm runs the GPU's fused kernel (a CPU run's composite saves more: see above).
    """
    cfg, device = model.cfg, next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    seq = local_seq(model)
    ids_BS = torch.zeros(micro_batch, seq, dtype=torch.long, device=device)
    x_SBD = None
    if not (chunk == 0 and model.stage.first):
        s = seq // model.mesh.tp.size if model.sp else seq
        # requires grad like a received activation, so the first layer saves what it saves in training
        x_SBD = torch.empty(s, micro_batch, cfg.hidden_size, dtype=dtype, device=device, requires_grad=True)
    params = list(model.parameters())
    with FusedAttentionSizes(compiled, fused_norm) if fused_attention else _nothing():
        # the ids double as labels: the loss saves its tensors with the real shapes
        return saved_bytes(lambda: model.forward_chunk(chunk, x_SBD, ids_BS, ids_BS), params)


@contextmanager
def _nothing():
    yield


def local_seq(model) -> int:
    """The tokens of a sequence this rank's model sees: S/cp."""
    return model.cfg.seq_length // model.mesh.cp.size


def block_activation_bytes(model, layer: int, micro_batch: int, fused_attention: bool = True) -> int:
    """Bytes one transformer block (global index `layer`, on this rank) saves for backward for one
    micro-batch: its input is [S (S/tp under sp), B, D] in the parameters' dtype."""
    cfg, p = model.cfg, next(model.parameters())
    s = local_seq(model) // model.mesh.tp.size if model.sp else local_seq(model)
    x_SBD = torch.empty(s, micro_batch, cfg.hidden_size, dtype=p.dtype, device=p.device, requires_grad=True)
    with FusedAttentionSizes() if fused_attention else _nothing():
        rope = model.rope_for(x_SBD.dtype)
        return saved_bytes(lambda: model.layers[str(layer)](x_SBD, rope), list(model.parameters()))


def head_activation_bytes(model, micro_batch: int, fused_attention: bool = True) -> int:
    """Bytes the output step (final norm, head and loss) saves for backward for one micro-batch on the last
    stage: its input is the last block's output [S (S/tp under sp), B, D] in the parameters' dtype."""
    cfg, p = model.cfg, next(model.parameters())
    s = local_seq(model) // model.mesh.tp.size if model.sp else local_seq(model)
    x_SBD = torch.empty(s, micro_batch, cfg.hidden_size, dtype=p.dtype, device=p.device, requires_grad=True)
    ids_BS = torch.zeros(micro_batch, local_seq(model), dtype=torch.long, device=p.device)
    with FusedAttentionSizes() if fused_attention else _nothing():
        return saved_bytes(lambda: model.head_output(x_SBD, ids_BS), list(model.parameters()))


def allocator_peak(fn) -> int:
    """Peak of the bytes allocated and not yet freed while fn() runs, above what was live before: the
    running sum of the CPU allocator's own events (the profiler with profile_memory), in time order."""
    from megaframe.training.phase_meter import allocator_profile, running_peak

    with allocator_profile() as prof:
        fn()
    return running_peak(prof)


class _WeightInputs(TorchFunctionMode):
    """Records what a split backward's W keeps per micro-batch: for every op that takes a weight (a
    parameter), the storages of its other tensor inputs (the layer's input, which W multiplies by the
    output grad) and its output's bytes (the output grad W reads, the same size)."""

    WEIGHTED = {"linear", "mm", "matmul", "addmm", "bmm", "embedding", "rms_norm", "layer_norm"}
    WEIGHTED |= {"_grouped_mm", "meta_grouped_mm"}  # the MoE experts' GEMMs, on a device and on meta
    """The ops that apply a weight (a transposed weight is a view of it: matched by storage)."""

    def __init__(self, params: Iterable[torch.Tensor]):
        super().__init__()
        self.params = {_storage_key(p) for p in params}
        self.inputs: dict[int, int] = {}
        self.out_bytes = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") not in self.WEIGHTED or not isinstance(out, torch.Tensor):
            return out
        flat = [a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        if any(_storage_key(a) in self.params for a in flat):
            for a in flat:
                if _storage_key(a) not in self.params and a.dtype.is_floating_point:
                    self.inputs.setdefault(_storage_key(a), a.untyped_storage().nbytes())
            self.out_bytes += out.numel() * out.element_size()
        return out

    @property
    def bytes(self) -> int:
        return sum(self.inputs.values()) + self.out_bytes


def w_fraction(model, chunk: int, micro_batch: int) -> float:
    """Share of a micro-batch chunk's saved activations that its pending W keeps once B has run (the
    weighted ops' inputs and output grads; the simulator's and the planner's `w_fraction`), capped at 1."""
    total = chunk_activation_bytes(model, chunk, micro_batch, fused_attention=True)
    cfg, p = model.cfg, next(model.parameters())
    seq = local_seq(model)
    ids_BS = torch.zeros(micro_batch, seq, dtype=torch.long, device=p.device)
    x_SBD = None
    if not (chunk == 0 and model.stage.first):
        s = seq // model.mesh.tp.size if model.sp else seq
        x_SBD = torch.empty(
            s, micro_batch, cfg.hidden_size, dtype=p.dtype, device=p.device, requires_grad=True
        )
    rec = _WeightInputs(model.parameters())
    with FusedAttentionSizes(), rec:
        model.forward_chunk(chunk, x_SBD, ids_BS, ids_BS)
    return min(1.0, rec.bytes / total) if total else 0.0
