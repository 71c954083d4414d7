"""Contiguous gradient and parameter buffers, cut into buckets, and this dp rank's ranges of them.

Layout of one buffer (there is one per parameter dtype and data-parallel axis, `buffer_groups`):

    params in reverse order of model.parameters() (roughly the order backward finishes them), whole
    params only, packed into buckets of at least `bucket_bytes` of fp32 grads; each bucket is padded
    to a multiple of dp elements, so the buffer is too.

        buffer   | bucket 0 (n_0 elements, padded)      | bucket 1 (n_1)        | ...
        rank r   |   [r·n_0/dp, (r+1)·n_0/dp) of bucket 0 | [r·n_1/dp, ...) of 1 | ...

    Element i of the grad buffer (fp32, or bf16: see below) and of the param buffer (the params' dtype) is the
    same parameter element: every parameter's `.data` is re-pointed at its slice of the param buffer, and
    its gradient (`p.main_grad`, also `p.grad` where the dtypes agree) is its slice of the grad buffer.

Each dp rank owns one contiguous range of every bucket (with one bucket: one range of the whole
buffer). Per-bucket ranges are what lets each bucket's reduce-scatter hand every rank its part the
moment that bucket's grads are final. A parameter may straddle two ranks' ranges (Megatron's "param
range within the bucket shard"): each rank sees a `Segment`, the part of one parameter it owns.

This rank's optimizer state (fp32 master where needed, Adam moments) is flat: the concatenation of its
bucket ranges, n_b / dp elements per bucket, `state_numel` in all.

Grads are fp32 unless optim.grad_reduce_dtype=bf16 and the params are bf16 (`grad_dtype`): then the grad
buffer, grad_shard and every Bucket.acc are bf16 (half the memory and half the reduce-scatter bytes), and
the reduced owned range is widened once per step into `grad32` (fp32, state_numel elements; its storage
exists only from the reduction to the next zero_grad) for the norm, the clip and AdamW on the fp32 master.

Where the reduced grads live depends on the ZeRO stage (`sharded_grads`):
    zero=1   the whole fp32 grad buffer is kept; this rank's final grads are its ranges of it
    zero=2   only `grad_shard` (state_numel fp32, laid out like the rank state) is kept. During backward a
             bucket's grads accumulate in a bucket-sized `Bucket.acc`, allocated when its first grad
             arrives, reduce-scattered into grad_shard and freed once the bucket is complete (every
             micro-batch). A `late` bucket (tied embedding) keeps its acc for the whole step: its grads are
             summed over the pipeline ends before the data-parallel reduction.
Lazy storage (as torch's AdamW and FSDP2): the optimizer's buffers are made with no storage (`lazy_zeros`)
and given it, zeroed, on first use (`give_storage`): grads and moments at the first zero_grad (or a backward,
step, save or load before one). Views taken before (p.main_grad, AdamW's segments and their .grad) stay valid,
as grad32's do across its resizes, so start-up holds the params only.
Here "dp" is the axis ZeRO shards over: dp itself, edp for experts, or an HSDP shard group (dp_shard).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from megaframe.parallel.mesh import Axis, Mesh


@dataclass
class Segment:
    """The part of `param` inside this rank's range: elements [param_lo, param_lo + numel) of the flat
    local (tp-sliced) parameter, at `buf_lo` in the buffer and at `state_lo` in the flat rank state."""

    param: nn.Parameter
    param_lo: int
    buf_lo: int
    state_lo: int
    numel: int


@dataclass(eq=False)
class Bucket:
    """Buffer elements [start, end) (end - start divisible by dp), holding whole `params`.

    `late` buckets hold a parameter whose grad is still summed with another pipeline stage's after
    backward (the tied embedding): they are only reduce-scattered in step()."""

    index: int
    params: list
    start: int
    end: int
    shard_lo: int
    """This rank's range in the buffer starts here; it is (end - start) / dp long."""
    state_lo: int
    """... and sits at this offset of the flat rank state."""
    late: bool = False
    ready: set = field(default_factory=set)
    work: object = None
    launched: bool = False
    acc: object = None
    """zero=2: the bucket-sized tensor (the buffer's grad dtype)
    this micro-batch's grads accumulate in (None when freed)."""

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_numel(self, dp: int) -> int:
        return self.numel // dp


def lazy_zeros(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """n elements whose memory is not allocated yet: the tensor sits on a storage of the right size with
    no data (a null pointer), so views taken now see the memory `give_storage` swaps in later. Never read
    or write it before (a resizable 0-byte storage would not do: making an n-element tensor on it
    allocates it)."""
    if torch.device(device).type == "meta":  # checkpoint planning's meta buffers hold nothing anyway
        return torch.empty(n, dtype=dtype, device=device)
    empty = torch._C._construct_storage_from_data_pointer(0, torch.device(device), n * dtype.itemsize)
    return torch.empty(0, dtype=dtype, device=device).set_(empty, 0, (n,))


def has_storage(t: torch.Tensor) -> bool:
    """Whether t (a whole tensor, not a view into one) has
    its memory: False for lazy_zeros before give_storage."""
    return t.is_meta or t.numel() == 0 or t.data_ptr() != 0


def give_storage(t: torch.Tensor | None) -> bool:
    """Allocate a lazy_zeros tensor's memory, zeroed (its views see it); False when it has it (or is None)."""
    if t is None or has_storage(t):
        return False
    mem = torch.UntypedStorage(t.numel() * t.element_size(), device=t.device)
    # The memory moves into the storage every view shares; `mem` is left with the null pointer.
    t.untyped_storage()._swap_data_ptr_(mem)
    with torch.no_grad():
        t.zero_()
    return True


def widens_grads(cfg) -> bool:
    """Whether bf16-reduced grads are widened into grad32 for the step: not when optim.step_kernel=compiled,
    whose pass reads them as they are (2 B an element, not a 6 B widening and a 4 B read)."""
    return cfg.step_kernel != "compiled"


def grad_dtype(reduce_dtype: str, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype a buffer's grads accumulate and are reduced in (optim.grad_reduce_dtype): bf16 only for
    bf16 params (config/checks.py refuses bf16 reduction of fp32 training); fp32 otherwise."""
    return torch.bfloat16 if reduce_dtype == "bf16" and param_dtype == torch.bfloat16 else torch.float32


def plan_buckets(numels: list[int], bucket_elems: int, dp: int) -> list[tuple[list[int], int, int]]:
    """Pack params (by flat size, in the given order) into buckets: [(param indices, start, padded end)]."""
    out, cur, start, size = [], [], 0, 0
    for i, n in enumerate(numels):
        cur.append(i)
        size += n
        if size >= bucket_elems or i == len(numels) - 1:
            # Padded to a multiple of dp: reduce-scatter needs equal blocks, and the zero padding adds
            # nothing to sums or norms.
            padded = -(-size // dp) * dp
            out.append((cur, start, start + padded))
            cur, start, size = [], start + padded, 0
    return out


def buffer_groups(params: list[nn.Parameter], mesh: Mesh) -> list[tuple[Axis, list[nn.Parameter]]]:
    """(shard axis, params) of each buffer, in order of first appearance: one per (dtype, data axis of the
    placement). Expert params are sharded and reduced over edp (the dp ranks holding the same experts),
    dense ones over dp, or under HSDP over their shard group (mesh.dp_shard; the shards are then
    all-reduced over mesh.dp_rep). The trainer's optimizer and the planner both build from this."""
    groups: dict[tuple, tuple[Axis, list[nn.Parameter]]] = {}
    for p in params:
        # experts: edp, or under HSDP its shard group (edp_shard, replicas edp_rep; rank_grid.py)
        axis = mesh.edp_shard if p.placement.expert else mesh.dp_shard
        # Keyed by dtype (one flat param buffer holds one dtype) and by expert-ness (a different reduce
        # axis); every rank of the axis sees the same params in the same order, so the buffers line up.
        groups.setdefault((p.dtype, p.placement.expert), (axis, []))[1].append(p)
    return list(groups.values())


def replicas_of(axis: Axis, mesh: Mesh) -> Axis:
    """HSDP: the ranks holding the same shard as this one over the shard axis `axis` (dp_rep for the dense
    shard group, edp_rep for the experts'); size 1 without HSDP."""
    if axis is mesh.dp_shard:
        return mesh.dp_rep
    if axis is mesh.edp_shard:
        return mesh.edp_rep
    return Axis("dp", 1, 0, (mesh.rank,), None, mesh.stats)


def bucket_plan(params: list[nn.Parameter], bucket_bytes: int, dp: int) -> tuple[list, list]:
    """(params in buffer order, plan_buckets of them): the layout FlatBuffer allocates."""
    ordered = params[::-1]  # backward finishes the last layers first
    # bucket_bytes counts fp32 grads (4 bytes each), whatever the params' dtype.
    return ordered, plan_buckets([p.numel() for p in ordered], max(1, bucket_bytes // 4), dp)


def group_plan(params: list[nn.Parameter], groups: list[list[nn.Parameter]], dp: int) -> tuple[list, list]:
    """zero=3's layout: one bucket per group (a transformer block, or the params outside blocks), so a
    block's params are gathered and freed as one; groups in reverse order, like bucket_plan."""
    mine = set(params)  # groups list the whole model's params; this buffer holds one dtype/axis of them
    ordered, plan, start = [], [], 0
    for g in reversed(groups):
        members = [p for p in reversed(g) if p in mine]
        if not members:
            continue
        size = sum(p.numel() for p in members)
        plan.append(
            (list(range(len(ordered), len(ordered) + len(members))), start, start + -(-size // dp) * dp)
        )
        ordered += members
        start = plan[-1][2]
    assert len(ordered) == len(params), "every param in exactly one group"
    return ordered, plan


class FlatBuffer:
    """The grad buffer (`grad_dtype`, fp32 by default) and param buffer (params' dtype) of params sharing one
    dtype, bucketed and split over dp as described above. Re-points every param's storage into the param
    buffer."""

    def __init__(
        self,
        params: list[nn.Parameter],
        bucket_bytes: int,
        dp_rank: int,
        dp_size: int,
        late: set[int],
        sharded_grads: bool = False,
        groups: list[list[nn.Parameter]] | None = None,
        grad_dtype: torch.dtype = torch.float32,
        device=None,
        whole_param: bool = True,
        lazy_grads: bool = False,
        widen: bool = True,
    ):
        """`whole_param=False` (ZeRO-3): no param buffer and no re-pointing; the optimizer gives the
        params their storage (bucket by bucket) and the master its values. `device`: where the buffers
        live (default: the params', which may be meta before ZeRO-3 materialises them). `lazy_grads`: the
        grad buffer (or shard) gets its storage only at alloc_grads (the optimizer's first backward).
        `widen=False`: no grad32; the norm and the update read bf16-reduced grads as they are."""
        self.dtype, self.grad_dtype = params[0].dtype, grad_dtype
        self.grad_elem = grad_dtype.itemsize
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.device = device = device or params[0].device
        ordered, plan = (
            bucket_plan(params, bucket_bytes, dp_size)
            if groups is None
            else group_plan(params, groups, dp_size)
        )
        self.numel = plan[-1][2] if plan else 0
        self.state_numel = self.numel // dp_size
        # zero=1: the whole grad buffer; zero=2: this rank's shard of it (see the module docstring)
        zeros = lazy_zeros if lazy_grads else (lambda n, dt, dev: torch.zeros(n, dtype=dt, device=dev))
        self.grad = None if sharded_grads else zeros(self.numel, grad_dtype, device)
        self.grad_shard = zeros(self.state_numel, grad_dtype, device) if sharded_grads else None
        # One tensor whose storage comes and goes (widen_owned / free_grad32): the AdamW segments' .grad
        # and the owned-grad list view it once, at construction, and stay valid across the resizes.
        # (not lazy_zeros: its storage is resized, and the null one cannot be; freed by the first zero_grad)
        self.grad32 = (
            None
            if grad_dtype == torch.float32 or not widen
            else torch.zeros(self.state_numel, dtype=torch.float32, device=device)
        )
        # Zeros, not empty: the padding belongs to no param;
        # zeros keep it deterministic in the master and gathers.
        self.param = torch.zeros(self.numel, dtype=self.dtype, device=device) if whole_param else None
        self._lay_out(ordered, plan, late)
        if whole_param:
            self._repoint(ordered)
        self.segments = self._segments()

    def _lay_out(self, ordered: list[nn.Parameter], plan, late: set[int]) -> None:
        """The buckets of `plan`, this rank's shard of each, and every param's offset and bucket."""
        dp_rank, dp_size = self.dp_rank, self.dp_size
        self.offset: dict[nn.Parameter, int] = {}
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[nn.Parameter, Bucket] = {}
        state_lo = 0
        for index, (idx, start, end) in enumerate(plan):
            members = [ordered[i] for i in idx]
            # The same arithmetic on every rank of the axis: rank r's range is block r of the bucket's
            # reduce-scatter, so the collective's block order and the ranges must agree.
            shard_lo = start + dp_rank * (end - start) // dp_size
            b = Bucket(
                index, members, start, end, shard_lo, state_lo, late=any(id(p) in late for p in members)
            )
            self.buckets.append(b)
            state_lo += b.shard_numel(dp_size)
            off = start
            for p in members:
                self.offset[p] = off
                self.bucket_of[p] = b
                off += p.numel()

    @torch.no_grad()
    def _repoint(self, params: list[nn.Parameter]) -> None:
        for p in params:
            view = self.param_view(p)
            view.copy_(p.data)
            # `.data` swap keeps the Parameter object (and the optimizer's and hooks' references to it)
            # while its storage becomes the buffer slice the all-gather writes into.
            p.data = view
            if self.grad is not None:
                p.main_grad = self.grad_view(p)

    def alloc_grads(self) -> None:
        """Storage for lazy grads (zeroed); a no-op once they have it."""
        give_storage(self.grad)
        give_storage(self.grad_shard)

    def grad_view(self, p: nn.Parameter) -> torch.Tensor:
        o = self.offset[p]
        return self.grad[o : o + p.numel()].view(p.shape)

    def acc_view(self, p: nn.Parameter) -> torch.Tensor:
        """zero=2: p's slice of its bucket's accumulation
        tensor, allocated (zeroed) if the bucket has none."""
        b = self.bucket_of[p]
        if b.acc is None:
            # Allocated lazily and freed after the bucket's reduce-scatter: at most the buckets in
            # flight hold a full-size fp32 copy, which is zero=2's memory saving.
            b.acc = torch.zeros(b.numel, dtype=self.grad_dtype, device=self.device)
        o = self.offset[p] - b.start
        return b.acc[o : o + p.numel()].view(p.shape)

    def owned_grad(self, b: Bucket) -> torch.Tensor:
        """This rank's reduced grads of bucket b: its range of the grad buffer, or of grad_shard."""
        if self.grad is not None:
            return self.shard(self.grad, b)
        return self.state_shard(self.grad_shard, b)

    def final_grad(self, b: Bucket) -> torch.Tensor:
        """This rank's reduced grads of bucket b as the update
        reads them: fp32 (grad32 under bf16 reduction)."""
        return self.owned_grad(b) if self.grad32 is None else self.state_shard(self.grad32, b)

    def owned_grad_at(self, seg: Segment) -> torch.Tensor:
        """The reduced fp32 grad of one segment (what the update reads; grad32's under bf16 reduction)."""
        if self.grad32 is not None:
            return self.grad32[seg.state_lo : seg.state_lo + seg.numel]
        if self.grad is not None:
            return self.grad[seg.buf_lo : seg.buf_lo + seg.numel]
        return self.grad_shard[seg.state_lo : seg.state_lo + seg.numel]

    @torch.no_grad()
    def widen_owned(self) -> None:
        """bf16 reduction: give grad32 its storage and copy this rank's reduced range into it (fp32)."""
        if self.grad32 is None:
            return
        self.grad32.untyped_storage().resize_(self.state_numel * 4)
        if self.grad_shard is not None:
            self.grad32.copy_(self.grad_shard)
            return
        for b in self.buckets:
            self.state_shard(self.grad32, b).copy_(self.owned_grad(b))

    def free_grad32(self) -> None:
        """Release grad32's storage (zero_grad): it is only needed from the reduction to the update."""
        if self.grad32 is not None:
            self.grad32.untyped_storage().resize_(0)

    def param_view(self, p: nn.Parameter) -> torch.Tensor:
        o = self.offset[p]
        return self.param[o : o + p.numel()].view(p.shape)

    def bucket_range(self, flat: torch.Tensor, b: Bucket) -> torch.Tensor:
        """b's elements of a buffer-shaped flat tensor (grad or param buffer)."""
        return flat[b.start : b.end]

    def shard(self, flat: torch.Tensor, b: Bucket) -> torch.Tensor:
        """This rank's range of bucket b in a buffer-shaped flat tensor."""
        return flat[b.shard_lo : b.shard_lo + b.shard_numel(self.dp_size)]

    def state_shard(self, state: torch.Tensor, b: Bucket) -> torch.Tensor:
        """Bucket b's part of a flat rank-state tensor (state_numel elements)."""
        return state[b.state_lo : b.state_lo + b.shard_numel(self.dp_size)]

    def _segments(self) -> list[Segment]:
        out = []
        for b in self.buckets:
            lo, hi = b.shard_lo, b.shard_lo + b.shard_numel(self.dp_size)
            for p in b.params:
                p_lo, p_hi = self.offset[p], self.offset[p] + p.numel()
                s_lo, s_hi = max(lo, p_lo), min(hi, p_hi)
                # A param may straddle two ranks' ranges: each rank keeps only its overlap.
                if s_lo < s_hi:
                    out.append(Segment(p, s_lo - p_lo, s_lo, b.state_lo + s_lo - lo, s_hi - s_lo))
        return out
