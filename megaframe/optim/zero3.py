"""ZeRO-3 (optim.zero=3): parameters live as this rank's 1/dp shard too; each gather unit's params
are all-gathered just before its forward and again before its backward, and freed after each.

Gather units (GPT.gather_units, in forward order): the input step (embedding, learned positions), each
transformer block, the output step (final norm and head, or the tied embedding). Every param is in
one, so nothing is kept whole: a rank holds 1/dp of the model (mem/params_bytes).
Built on the ZeRO-2 optimizer (zero.py: grads reduce-scattered into the owned shard every micro-batch)
with two changes of layout (buffer.group_plan, param_gather.zero3_groups): one bucket per unit (a
param two units read, the tied embedding in one process, or one summed over the pipeline ends, in a
bucket of its own); and the owned range of every param is kept in an fp32 tensor (`always_master`),
which the update writes and the gathers read.

Start-up: build_model leaves the params on the meta device; here each bucket gets its gathered tensor
(freed at once) and the master of each owned segment is drawn from init (layers/shard.py init_flat:
seed, global name, position: the values the whole param would get). So no rank ever holds its whole
local model, in any dtype.

Each bucket's parameters are views of one bucket-sized tensor of its own. Freeing resizes that tensor's
storage to 0 bytes and gathering resizes it back and all-gathers into it, so the views (p.data, and the
weights autograd saved for backward) stay the same tensors and see the gathered values again before
the unit's backward runs (the storage trick of PyTorch's FSDP1). Under pipeline parallelism the hooks
act per unit whatever the schedule (vpp included).

    forward pre-hook of unit i      wait for (or run) the gather of unit i; launch unit i+1's
    forward hook of unit i          free unit i
    backward pre-hook of unit i     gather unit i again; launch unit i-1's (if its backward reads it)
    backward hook of unit i         free unit i (its input grad is computed: the weights are done)
The input step's backward (an index-add, an add) reads no weights: it has no backward hooks, and is
not gathered for backward.

Under train.precision=fp8 (tensorwise) each unit's float8 linears' weights are a bucket of their own,
gathered as float8 (1 byte an element; its own uint8 storage, freed and regathered the same way) for
forwards and backwards, and as bf16 only by sync_params: optim/float8_gather.py.

`optim.reshard_after_forward=false` (torchtitan's and Megatron's choice for pipelines, where a rank
runs several micro-batches' forwards before their backwards) keeps a unit gathered from its first
forward of the step to its last backward (backward_context(is_last=True) of its chunk): one gather
per unit per step instead of two per micro-batch, for the memory of the whole chunk's params.

After step() every bucket is stale and freed; each is gathered at its next use. sync_params() gathers
all of them (readers of whole params outside a forward: tests, a checkpoint load into whole params);
the next forward frees them again. A save gathers nothing: each rank writes its owned segments
(weight_segments, the master cast to the params' dtype), after settle().

Per step, B the padded buffer, g the grad bytes (4, or 2 under optim.grad_reduce_dtype=bf16: buffer.py):
gathers (dp-1)/dp·n' per use of each bucket (n' in the params' dtype; a block twice per micro-batch,
forward and backward: optim/sizing.py gathers_per_step), reduce-scatters M·(dp-1)/dp·g·B, and the norm
scalar (under HSDP dp is the shard group, plus the all-reduce of the grad shard over its replicas; under
cp, dp is cp·dp). Composes with tp/sp, pp/vpp, ep (expert params in a buffer of their own, sharded over
edp, one bucket per block too), cp (shards and gathers over cp·dp, both cp_comm kinds), HSDP and full
recompute (the re-run forward inside backward neither frees nor prefetches) and train.compile: the blocks'
forwards are compiled, so these hooks run eagerly around the graph, never traced into it
(model/parallelize.py).
"""

from __future__ import annotations

import torch
from torch import nn

from megaframe.layers.shard import init_flat, materialize
from megaframe.optim.buffer import Bucket, FlatBuffer, Segment, widens_grads
from megaframe.optim.float8_gather import Float8Gather, float8_weights, split_groups
from megaframe.optim.param_gather import gather_units, zero3_groups
from megaframe.optim.zero import ZeroOptimizer
from megaframe.parallel import comm


class Zero3Optimizer(ZeroOptimizer):
    """ZeroOptimizer with parameters sharded too (see the module docstring)."""

    always_master = True

    def __init__(self, model: nn.Module, cfg, mesh):
        self.units = gather_units(model)
        f8, f8_config = float8_weights(model)
        # train.precision=fp8 (tensorwise): the float8 linears' weights gathered as float8 (float8_gather.py)
        self.float8 = Float8Gather(f8, f8_config, mesh.device) if f8 else None
        self._names = {p: n for n, p in model.named_parameters()}
        self._init = getattr(model, "init_spec", None)
        self._from_init: set = set()  # params that were meta: their master segments are drawn from init
        super().__init__(model, cfg, mesh)
        self._syncing = False  # sync_params is gathering everything: not the training working set
        self.gathered_high = 0  # the most gathered param bytes ever alive at once, saves included (tests)
        self.resident: list[tuple[FlatBuffer, Bucket]] = []
        self.block_buckets: list[list[tuple[FlatBuffer, Bucket]]] = [[] for _ in self.units]
        where: dict = {}
        for i, (_, params, _) in enumerate(self.units):
            for p in params:
                where.setdefault(id(p), []).append(i)
        for buf in self.buffers:
            for b in buf.buckets:
                b.fresh, b.fresh8, b.gwork = True, False, None
                units = where.get(id(b.params[0]))
                if units is None:
                    self.resident.append((buf, b))
                for i in units or []:
                    self.block_buckets[i].append((buf, b))
        self._seen = {p: p._version for p in self._seen}
        for i, (unit, _, backward_reads) in enumerate(self.units):
            self._hooks += [
                unit.register_forward_pre_hook(self._on(i, "fwd_pre")),
                unit.register_forward_hook(self._on(i, "fwd_post")),
            ]
            if backward_reads:  # else (the input step) nothing to gather for its backward; freed at step()
                self._hooks += [
                    unit.register_full_backward_pre_hook(self._on(i, "bwd_pre")),
                    unit.register_full_backward_hook(self._on(i, "bwd_post")),
                ]
        # Every bucket starts freed (params given by a checkpoint were folded into the master above); a
        # forward gathers what it needs, sync_params() everything (readers outside a forward).
        self.gathered_params = sum(
            b.numel * b.pfull.element_size()
            for bs in self.block_buckets
            for _, b in bs
            if b.pfull.untyped_storage().nbytes()
        )
        self.launch(None)

    def _make_buffer(self, params, bucket_bytes, axis, late) -> FlatBuffer:
        groups = zero3_groups(params, self.units)
        if self.float8 is not None:
            groups = split_groups(groups, set(self.float8.index))
        buf = FlatBuffer(
            params,
            bucket_bytes,
            axis.rank,
            axis.size,
            late,
            sharded_grads=True,
            groups=groups,
            grad_dtype=self._grad_dtype(params),
            device=self.mesh.device,
            whole_param=False,
            lazy_grads=True,
            widen=widens_grads(self.cfg),
        )
        for b in buf.buckets:
            self._bucket_storage(buf, b)
        return buf

    @torch.no_grad()
    def _bucket_storage(self, buf: FlatBuffer, b: Bucket) -> None:
        """The bucket's own gathered tensor, its params views of it. Params still on meta (build_model's)
        get their storage here, freed at once: the master is drawn from init (`_segment_values`), and no
        rank ever holds its whole local model. Params with values (a model built outside build_model) copy
        them in and keep them until build_state has read its segments."""
        b.pfull = torch.empty(b.numel, dtype=buf.dtype, device=buf.device)
        o = 0
        for p in b.params:
            view = b.pfull[o : o + p.numel()].view(p.shape)
            o += p.numel()
            if p.is_meta:
                self._from_init.add(p)
                materialize(p, view.new_empty(0))  # off meta first: .data = refuses a meta param
            else:
                view.copy_(p.detach())
            # .data =, not a Parameter made from the view: p keeps a version counter of its own, so the
            # gathers writing into pfull do not look like in-place changes of the weights autograd saved
            p.data = view
        b.pfull[o:].zero_()  # the padding: zeros, as the master's
        b.f8 = None
        if self.float8 is not None and self.float8.holds(b):  # after materialize: it swaps p's attributes
            self.float8.attach(b)
        if all(p in self._from_init for p in b.params):
            b.pfull.untyped_storage().resize_(0)

    def _segment_values(self, seg: Segment) -> torch.Tensor:
        """A segment's starting values in the params' dtype: drawn from init (seed, global name, position:
        the values the whole param would get) or read from the param it was given."""
        p = seg.param
        if p in self._from_init:
            assert self._init is not None, "a meta model without init_spec: build it with build_model"
            vals = init_flat(self._names[p], p.placement.shard, self._init, seg.param_lo, seg.numel)
            return vals.to(p.device, p.dtype)
        return p.detach().reshape(-1)[seg.param_lo : seg.param_lo + seg.numel]

    def _make_param_gather(self, model):
        return self  # wait() / launch() / in_flight below

    # ------------------------------------------------------------------ gather and free

    def _on(self, i: int, when: str):
        def hook(module, *args):
            # a forward inside backward is train.recompute=full's re-run: the block's backward follows and
            # needs its params, and the next block to prefetch is the previous one (bwd_pre launched it)
            # Not a host sync: the graph task id is autograd-engine state (-1 outside a backward).
            recompute = when.startswith("fwd") and torch._C._current_graph_task_id() != -1
            if when in ("fwd_pre", "bwd_pre"):
                self._ensure(i)
                nxt = i + 1 if when == "fwd_pre" else i - 1
                # backward prefetches only a unit whose backward reads its params (not the input step)
                if not recompute and (when == "fwd_pre" or (nxt >= 0 and self.units[nxt][2])):
                    self._prefetch(nxt)
            elif recompute:
                pass
            elif self.cfg.reshard_after_forward or (when == "bwd_post" and self._last):
                self._free(i)  # else kept from the first forward to the last backward of the step

        return hook

    def _launch_gather(self, buf: FlatBuffer, b: Bucket) -> None:
        st = self.states[self.buffers.index(buf)]
        if b.f8 is not None and not self._syncing:  # a forward's or backward's use: the float8 weights
            self._launch_float8_gather(buf, b, st)
            return
        if b.pfull.untyped_storage().nbytes() == 0:
            # Resize the storage, not a new tensor: p.data views and autograd's saved weights point at it.
            b.pfull.untyped_storage().resize_(b.numel * b.pfull.element_size())
            if all(b is not x for _, x in self.resident):
                self.gathered_params += b.numel * b.pfull.element_size()
                if not self._syncing:  # the training working set, not a checkpoint's gather-everything
                    self.gathered_peak = max(self.gathered_peak, self.gathered_params + self._acc_bytes)
                self.gathered_high = max(self.gathered_high, self.gathered_params)
        n = b.shard_numel(buf.dp_size)
        mine = b.pfull[buf.dp_rank * n : (buf.dp_rank + 1) * n]
        # From the fp32 master, not a stale bf16 copy: the master is what the update wrote.
        with torch.no_grad():
            mine.copy_(buf.state_shard(st.master, b))
        b.gwork = comm.all_gather_flat(b.pfull, mine, buf.axis, async_op=True)
        b.fresh = True

    def _launch_float8_gather(self, buf: FlatBuffer, b: Bucket, st) -> None:
        """b's float8 weights: this rank's range cast to float8 (1 byte per element) and all-gathered."""
        if self.float8.stale:  # the master changed (a step, a load, writes after sync_params): new scales
            self._resync_master()  # writes into gathered bf16 params land in the master first
            self.float8.update_scales(self.buffers, self.states)
        if b.f8.untyped_storage().nbytes() == 0:
            b.f8.untyped_storage().resize_(b.numel)
            self.gathered_params += b.numel
            self.gathered_peak = max(self.gathered_peak, self.gathered_params + self._acc_bytes)
            self.gathered_high = max(self.gathered_high, self.gathered_params)
        n = b.shard_numel(buf.dp_size)
        mine8 = b.f8[buf.dp_rank * n : (buf.dp_rank + 1) * n]
        self.float8.cast_shard(buf, b, buf.state_shard(st.master, b), mine8)
        b.gwork = comm.all_gather_flat(b.f8, mine8, buf.axis, async_op=True)
        b.fresh8 = True

    def _prefetch(self, i: int) -> None:
        if 0 <= i < len(self.units):
            for buf, b in self.block_buckets[i]:
                if not (b.fresh8 if b.f8 is not None and not self._syncing else b.fresh):
                    self._launch_gather(buf, b)

    def _ensure(self, i: int) -> None:
        self._prefetch(i)
        for _, b in self.block_buckets[i]:
            if b.gwork is not None:
                b.gwork.wait()
                b.gwork = None

    def _free(self, i: int) -> None:
        if not any(_held(b) or b.gwork is not None for _, b in self.block_buckets[i]):
            # already freed (meta start-up, or freed twice): no storage to read
            for _, b in self.block_buckets[i]:
                b.fresh = b.fresh8 = False
            return
        # Last chance to see writes made from outside into
        # the gathered params: after the resize they are gone.
        self._resync_master([p for _, b in self.block_buckets[i] for p in b.params])
        for _, b in self.block_buckets[i]:
            if b.gwork is not None:  # a prefetch never used (eval without backward): let it land first
                b.gwork.wait()
                b.gwork = None
            if b.pfull.untyped_storage().nbytes():
                self.gathered_params -= b.numel * b.pfull.element_size()
                # Safe only after the wait above: NCCL could still be writing into this storage.
                b.pfull.untyped_storage().resize_(0)
            if b.f8 is not None and b.f8.untyped_storage().nbytes():
                self.gathered_params -= b.numel
                b.f8.untyped_storage().resize_(0)
            b.fresh = b.fresh8 = False

    # ------------------------------------------------------------------ the ParamGather interface

    in_flight = 0
    works: list = []

    def wait(self, upto=None) -> None:
        """Land every gather in flight (what ZeroOptimizer waits for before a step or a backward)."""
        for buf in self.buffers:
            for b in buf.buckets:
                if b.gwork is not None:
                    b.gwork.wait()
                    b.gwork = None

    def sync_params(self) -> None:
        """Gather every block (checkpoints and tests read whole params); the next forward frees them."""
        self._master_may_change()  # the reader may write into the gathered params
        self._syncing = True
        try:
            for i in range(len(self.units)):
                self._ensure(i)
        finally:
            self._syncing = False
        self.wait()

    def settle(self) -> None:
        """Before a save: gathers in flight landed, writes made from outside into gathered params folded
        into the master; nothing is gathered (a save writes each rank's segments: weight_segments)."""
        self.wait()
        self._resync_master()

    def weight_segments(self, p: nn.Parameter) -> list[tuple[int, int, torch.Tensor]]:
        """This rank's segments of p's weights, no collective and no gather: (first element of the flat
        local param, length, the values in p's dtype: the master cast as a gather would)."""
        return [(lo, n, views["master"].to(p.dtype)) for lo, n, views in self.state_segments(p)]

    def _resync_master(self, params=None) -> None:
        """As ZeroOptimizer's, for params whose storage is gathered now (a freed block is re-read when
        the params written from outside were gathered: just before it is freed)."""
        keep, ids = self._seen, None if params is None else {id(p) for p in params}
        self._seen = {
            p: v
            for p, v in keep.items()
            if (ids is None or id(p) in ids) and p.untyped_storage().nbytes() > 0
        }
        try:
            super()._resync_master()
        finally:
            keep.update(self._seen)
            self._seen = keep

    def launch(self, _gather_bucket) -> None:
        """After the update: the resident bucket is gathered now, blocks at their next use."""
        self._master_may_change()
        for i in range(len(self.units)):
            self._free(i)
        for buf, b in self.resident:
            self._launch_gather(buf, b)
        # Waited at once: the resident bucket is read outside any hooked module (the head), so no
        # forward pre-hook would wait for it.
        self.wait()

    def _master_may_change(self) -> None:
        """The float8 weights' scales are recomputed at their next gather (every rank calls this alike)."""
        if self.float8 is not None:
            self.float8.stale = True

    def load_targets(self, p: nn.Parameter):
        self._master_may_change()  # a checkpoint load writes into the master
        return super().load_targets(p)

    def param_home(self, p: nn.Parameter) -> list[tuple[int, int, torch.Tensor]] | None:
        """Where a checkpoint's value of p is read to (checkpoint/load.py): None while p is gathered (into p);
        for a freed block, this rank's segments of p's fp32 master ((first element of p, length, 1-D view)),
        which the block's next gather reads: each rank reads its own share of the weights, nothing whole."""
        if p.untyped_storage().nbytes() > 0:
            return None
        st = self.states[self.buffers.index(self._buffer_of[p])]
        return [
            (seg.param_lo, seg.numel, st.master[seg.state_lo : seg.state_lo + seg.numel])
            for seg, _ in self._segs_of.get(p, [])
        ]

    def memory_bytes(self) -> dict[str, int]:
        """Params: this rank's shards (the fp32 owned range) plus the resident bucket; grads and optimizer
        state as ZeRO-2 (the fp32 owned range is the params', not counted twice); the peak of gathered
        block params plus transient grads."""
        out = super().memory_bytes()
        shard = sum(4 * buf.state_numel for buf in self.buffers)
        resident = sum(b.numel * b.pfull.element_size() for _, b in self.resident)
        out["mem/optim_bytes"] -= shard
        out["mem/params_bytes"] = shard + resident
        return out


def _held(b: Bucket) -> bool:
    """Whether b's gathered storage (bf16, or its float8 one) holds memory now."""
    return bool(b.pfull.untyped_storage().nbytes() or (b.f8 is not None and b.f8.untyped_storage().nbytes()))
