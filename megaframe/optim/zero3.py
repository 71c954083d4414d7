"""ZeRO-3 (optim.zero=3): parameters live as this rank's 1/dp shard too; each transformer block's params
are all-gathered just before its forward and again before its backward, and freed after each.

Built on the ZeRO-2 optimizer (zero.py: grads reduce-scattered into the owned shard every micro-batch)
with two changes of layout (buffer.group_plan): one bucket per transformer block, and one for every
param outside the blocks (embeddings, final norm, head); and the owned range of every param is kept in
an fp32 tensor (`always_master`), which the update writes and the gathers read.

Each bucket's parameters are views of one bucket-sized tensor of its own. Freeing resizes that tensor's
storage to 0 bytes and gathering resizes it back and all-gathers into it, so the views (p.data, and the
weights autograd saved for backward) stay the same tensors and see the gathered values again before
the block's backward runs (the storage trick of PyTorch's FSDP1). Under pipeline parallelism the hooks
act per block whatever the schedule (vpp included); the tied embedding's copy on each pipeline end sits
in the bucket outside blocks, whose grads are summed over the ends before their reduce-scatter.

    forward pre-hook of block i     wait for (or run) the gather of block i; launch block i+1's
    forward hook of block i         free block i
    backward pre-hook of block i    gather block i again; launch block i-1's
    backward hook of block i        free block i (its input grad is computed: the weights are done)

`optim.reshard_after_forward=false` (torchtitan's and Megatron's choice for pipelines, where a rank
runs several micro-batches' forwards before their backwards) keeps a block gathered from its first
forward of the step to its last backward (backward_context(is_last=True) of its chunk): one gather
per block per step instead of two per micro-batch, for the memory of the whole chunk's params.

The bucket outside the blocks stays gathered: the output head reads the embedding's or its own weight
inside the model's forward, not through a module call. After step() every bucket is stale: the
resident one is gathered again at once, the blocks at their next forward. sync_params() gathers all of
them (readers outside a forward: checkpoints); the next forward frees them again.

Per step, B the padded buffer of the blocks and R the resident bucket: gathers 2·M·(dp-1)/dp·B' (B' in
the params' dtype, once for forward and once for backward per micro-batch), reduce-scatters
M·(dp-1)/dp·4(B+R), the resident gather (dp-1)/dp·R', and the norm scalar (under HSDP dp is the shard
group, plus the all-reduce of the grad shard over its replicas; under cp, dp is cp·dp). Composes with
tp/sp, pp/vpp, ep (expert params in a buffer of their own, sharded over edp, one bucket per block too),
cp (shards and gathers over cp·dp, both cp_comm kinds), HSDP and full recompute
(the re-run forward inside backward neither frees nor prefetches); refused with compile (config_checks):
hooks inside compiled blocks are not handled.
"""
from __future__ import annotations

import torch
from torch import nn

from megaframe.optim.buffer import Bucket, FlatBuffer
from megaframe.optim.param_gather import blocks_of
from megaframe.optim.zero import ZeroOptimizer
from megaframe.parallel import comm


class Zero3Optimizer(ZeroOptimizer):
    """ZeroOptimizer with parameters sharded too (see the module docstring)."""

    always_master = True

    def __init__(self, model: nn.Module, cfg, mesh):
        self.blocks = blocks_of(model)
        super().__init__(model, cfg, mesh)
        self._syncing = False  # sync_params is gathering everything: not the training working set
        self.resident: list[tuple[FlatBuffer, Bucket]] = []
        self.block_buckets: list[list[tuple[FlatBuffer, Bucket]]] = [[] for _ in self.blocks]
        where = {id(p): i for i, blk in enumerate(self.blocks) for p in blk.parameters()}
        for buf in self.buffers:
            for b in buf.buckets:
                b.pfull = buf.param[b.start:b.end].clone()  # its own storage, freed and re-gathered
                b.fresh, b.gwork = True, None
                o = b.start
                for p in b.params:
                    p.data = b.pfull[o - b.start:o - b.start + p.numel()].view(p.shape)
                    o += p.numel()
                i = where.get(id(b.params[0]))
                (self.resident if i is None else self.block_buckets[i]).append((buf, b))
            buf.param = None  # the whole buffer is not kept
        self._seen = {p: p._version for p in self._seen}
        for i, blk in enumerate(self.blocks):
            self._hooks += [blk.register_forward_pre_hook(self._on(i, "fwd_pre")),
                            blk.register_forward_hook(self._on(i, "fwd_post")),
                            blk.register_full_backward_pre_hook(self._on(i, "bwd_pre")),
                            blk.register_full_backward_hook(self._on(i, "bwd_post"))]
        # params stay gathered until the first forward frees them: a checkpoint loads into whole params.
        # Bytes of block params gathered now (the resident bucket is counted in mem/params_bytes).
        self.gathered_params = sum(b.numel * b.pfull.element_size() for bs in self.block_buckets for _, b in bs)

    def _make_buffer(self, params, bucket_bytes, axis, late) -> FlatBuffer:
        outside = [p for p in params if all(p is not q for blk in self.blocks for q in blk.parameters())]
        groups = [outside] + [list(blk.parameters()) for blk in self.blocks]
        return FlatBuffer(params, bucket_bytes, axis.rank, axis.size, late, sharded_grads=True, groups=groups)

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
                if not recompute:
                    self._prefetch(i + 1 if when == "fwd_pre" else i - 1)
            elif recompute:
                pass
            elif self.cfg.reshard_after_forward or (when == "bwd_post" and self._last):
                self._free(i)  # else kept from the first forward to the last backward of the step
        return hook

    def _launch_gather(self, buf: FlatBuffer, b: Bucket) -> None:
        st = self.states[self.buffers.index(buf)]
        if b.pfull.untyped_storage().nbytes() == 0:
            # Resize the storage, not a new tensor: p.data views and autograd's saved weights point at it.
            b.pfull.untyped_storage().resize_(b.numel * b.pfull.element_size())
            if all(b is not x for _, x in self.resident):
                self.gathered_params += b.numel * b.pfull.element_size()
                if not self._syncing:  # the training working set, not a checkpoint's gather-everything
                    self.gathered_peak = max(self.gathered_peak, self.gathered_params + self._acc_bytes)
        n = b.shard_numel(buf.dp_size)
        mine = b.pfull[buf.dp_rank * n:(buf.dp_rank + 1) * n]
        # From the fp32 master, not a stale bf16 copy: the master is what the update wrote.
        with torch.no_grad():
            mine.copy_(buf.state_shard(st.master, b))
        b.gwork = comm.all_gather_flat(b.pfull, mine, buf.axis, async_op=True)
        b.fresh = True

    def _prefetch(self, i: int) -> None:
        if 0 <= i < len(self.blocks):
            for buf, b in self.block_buckets[i]:
                if not b.fresh:
                    self._launch_gather(buf, b)

    def _ensure(self, i: int) -> None:
        self._prefetch(i)
        for _, b in self.block_buckets[i]:
            if b.gwork is not None:
                b.gwork.wait()
                b.gwork = None

    def _free(self, i: int) -> None:
        # Last chance to see writes made from outside into the gathered params: after the resize they are gone.
        self._resync_master([p for _, b in self.block_buckets[i] for p in b.params])
        for _, b in self.block_buckets[i]:
            if b.gwork is not None:  # a prefetch never used (eval without backward): let it land first
                b.gwork.wait()
                b.gwork = None
            if b.pfull.untyped_storage().nbytes():
                self.gathered_params -= b.numel * b.pfull.element_size()
                # Safe only after the wait above: NCCL could still be writing into this storage.
                b.pfull.untyped_storage().resize_(0)
            b.fresh = False

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
        self._syncing = True
        try:
            for i in range(len(self.blocks)):
                self._ensure(i)
        finally:
            self._syncing = False
        self.wait()

    def _resync_master(self, params=None) -> None:
        """As ZeroOptimizer's, for params whose storage is gathered now (a freed block is re-read when
        the params written from outside were gathered: just before it is freed)."""
        keep, ids = self._seen, None if params is None else {id(p) for p in params}
        self._seen = {p: v for p, v in keep.items() if (ids is None or id(p) in ids)
                      and p.untyped_storage().nbytes() > 0}
        try:
            super()._resync_master()
        finally:
            keep.update(self._seen)
            self._seen = keep

    def launch(self, _gather_bucket) -> None:
        """After the update: the resident bucket is gathered now, blocks at their next use."""
        for i in range(len(self.blocks)):
            self._free(i)
        for buf, b in self.resident:
            self._launch_gather(buf, b)
        # Waited at once: the resident bucket is read outside any hooked module (the head), so no
        # forward pre-hook would wait for it.
        self.wait()

    def param_home(self, p: nn.Parameter) -> list[tuple[int, int, torch.Tensor]] | None:
        """Where a checkpoint's value of p is read to (checkpoint/load.py): None while p is gathered (into p);
        for a freed block, this rank's segments of p's fp32 master ((first element of p, length, 1-D view)), which
        the block's next gather reads: each rank reads its own share of the weights, nothing whole."""
        if p.untyped_storage().nbytes() > 0:
            return None
        st = self.states[self.buffers.index(self._buffer_of[p])]
        return [(seg.param_lo, seg.numel, st.master[seg.state_lo:seg.state_lo + seg.numel])
                for seg, _ in self._segs_of.get(p, [])]

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
