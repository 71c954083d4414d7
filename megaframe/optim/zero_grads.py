"""ZeRO-1/2's gradient side (zero.py's ZeroOptimizer mixes it in): the backward hooks that fold each grad
into the flat buffers and launch a bucket's reduce-scatter once backward has finished it, and the
finalize.GradSource of the step (the reduction's end, this rank's final grads).

zero=2 keeps no grad buffer (buffer.py): in EVERY micro-batch's backward the hook adds p.grad into its
bucket's `acc` (allocated on the bucket's first grad) and frees p.grad; the hook completing a bucket
launches its reduce-scatter in place on acc, and once that has landed (waited for when the next bucket
is launched, or at the end of the micro-batch's backward) this rank's part is added into grad_shard and
acc is freed. So at most about two buckets of full-size grads exist at once (mem/gathered_peak_bytes),
and the dp traffic is one reduce-scatter per micro-batch instead of one per step. A bucket left
incomplete at the end of a micro-batch (a param without a grad, a bucket spanning two vpp chunks) is
reduce-scattered then, in bucket order. Every dp rank must use the same params in a micro-batch (they
run the same model), or their collectives would not match.

HSDP: after the reduce-scatters, this rank's reduced shard is all-reduced over the replicas (buf.rep) once
per step, in reduce_data_parallel.

optim.grad_reduce_dtype=bf16 (bf16 params only): the grad buffer, grad_shard and the buckets' acc are
bf16, so "fp32" above reads "bf16" for everything up to the reduction (zero=1 bf16 params then accumulate
straight into the buffer, as fp32 ones do); the reduce-scatters and HSDP's all-reduce send half the bytes.
reduce_data_parallel then widens the owned range into the buffer's grad32 (fp32) and the tp sum, norm,
clip and AdamW read that. No extra scaling is needed: the loss is divided by the global token count, so
what is summed is already each rank's share of the mean (Megatron scales by 1/dp before its bf16 reduce
for the same reason: a sum of already-averaged values keeps the magnitude of one).
(optim.step_kernel=compiled reads the bf16 grads as they are: no grad32, buffer.widens_grads.)
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from megaframe.layers import wgrad
from megaframe.optim.buffer import Bucket, FlatBuffer
from megaframe.optim.finalize import all_reduce_tensors
from megaframe.parallel import comm
from megaframe.parallel.placement import Placement


class ZeroGradReduce:
    """The backward and GradSource half of ZeroOptimizer: reads its buffers, stage, overlap and params."""

    def backward_context(self, is_last: bool):
        @contextlib.contextmanager
        def ctx():
            self._last = is_last
            self.param_gather.wait()  # backward reads the params (a chunk run without its forward's hooks)
            try:
                yield
                if self.stage == 2:  # no full-size grads survive a micro-batch (late buckets aside)
                    self._launch_rest(late=False)
                    self._drain(keep=0)
            finally:
                self._last = False

        return ctx()

    def _grad_ready(self, p: nn.Parameter) -> None:
        """Post-accumulate hook: fold a separate grad into the fp32 buffer (zero=2: the bucket's acc); on
        the last backward (zero=2: every backward), mark p ready and launch its bucket's reduce-scatter
        once every param of the bucket is ready."""
        self.make_grads()  # a backward without a zero_grad since construction
        buf = self._buffer_of[p]
        b = buf.bucket_of[p]
        if self.stage == 2:
            fresh = b.acc is None
            main = buf.acc_view(p)
            if fresh:
                self._note_acc(b.numel * buf.grad_elem)
        else:
            main = p.main_grad
        if self.stage == 1 and wgrad.take_fused(main):
            p.grad = (
                None  # the GEMM wrote main itself; p.grad is the never-written tensor that fired this hook
            )
        elif p.grad is not None and p.grad.data_ptr() != main.data_ptr():
            # bf16 params into fp32 grads, zero=2, or a grad someone replaced; zero=1's first grad of the
            # step is copied (zero_grad zeroed nothing)
            if self.stage == 1 and wgrad.note_written(main):
                main.copy_(p.grad)
            else:
                main.add_(p.grad)
            p.grad = main if self.stage == 1 and main.dtype == p.dtype else None
        if not ((self._last or self.stage == 2) and self.overlap):
            return
        b.ready.add(p)
        if not b.late and not b.launched and len(b.ready) == len(b.params):
            # Every dp rank runs the same graph, so its hooks complete the buckets in the same order and
            # the async reduce-scatters are issued in matching order on every rank.
            self._launch(buf, b)

    def _note_acc(self, nbytes: int) -> None:
        self._acc_bytes += nbytes
        self.gathered_peak = max(self.gathered_peak, self._acc_bytes)

    def _launch(self, buf: FlatBuffer, b: Bucket) -> None:
        """Async reduce-scatter of bucket b over the shard axis, in place: this rank's range ends up summed
        (zero=2: in acc's range, added into grad_shard by _drain)."""
        b.launched = True
        if self.stage == 1:
            b.work = comm.reduce_scatter_flat(
                buf.shard(buf.grad, b), buf.bucket_range(buf.grad, b), buf.axis, async_op=True
            )
            return
        n = b.shard_numel(buf.dp_size)
        # Output is block dp_rank of acc itself: no extra shard-sized buffer while the bucket flies.
        b.work = comm.reduce_scatter_flat(
            b.acc[buf.dp_rank * n : (buf.dp_rank + 1) * n], b.acc, buf.axis, async_op=True
        )
        self._pending.append((buf, b))
        self._drain(keep=1)  # the one just launched may fly on; older ones land and free their acc

    def _launch_rest(self, late: bool) -> None:
        """zero=2: launch, in bucket order, every bucket holding grads not yet launched (late ones only
        when `late`: in step, after their sum over the pipeline ends)."""
        for buf in self.buffers:
            for b in buf.buckets:
                if b.acc is not None and not b.launched and (late or not b.late):
                    self._launch(buf, b)

    def _drain(self, keep: int) -> None:
        """zero=2: wait for all but the newest `keep` reduce-scatters; add their range into grad_shard and
        free the bucket's acc (a late bucket's acc is kept: p.main_grad views it until zero_grad)."""
        while len(self._pending) > keep:
            # Oldest first: collectives on one group complete in
            # launch order, so no wait is longer than needed.
            buf, b = self._pending.pop(0)
            if b.work is not None:
                b.work.wait()
                b.work = None
            n = b.shard_numel(buf.dp_size)
            buf.owned_grad(b).add_(b.acc[buf.dp_rank * n : (buf.dp_rank + 1) * n])
            b.ready.clear()
            b.launched = False
            if not b.late:
                b.acc = None
                self._acc_bytes -= b.numel * buf.grad_elem

    def _wait_all(self) -> None:
        # Also from zero_grad: no reduce-scatter may still be writing into a buffer about to be zeroed.
        self._drain(keep=0)
        for buf in self.buffers:
            for b in buf.buckets:
                if b.work is not None:
                    b.work.wait()
                    b.work = None

    # ------------------------------------------------------------------ finalize.GradSource

    sharded = True

    def tied_grads(self) -> list[torch.Tensor]:
        return [p.main_grad for p in self.params if p.placement.pp_tied]

    def reduce_data_parallel(self) -> None:
        self.make_grads()  # a step with no backward since construction reduces zeros
        if self.stage == 2:
            self._launch_rest(late=True)
        else:
            for buf in self.buffers:  # in bucket order: the same order on every dp rank
                for b in buf.buckets:
                    if not b.launched:
                        self._launch(buf, b)
        self._wait_all()
        # HSDP: each shard group reduced its own samples; sum the shards over the groups (one all-reduce
        # per buffer: zero=2's grad_shard is contiguous, zero=1's ranges are flattened by all_reduce_tensors)
        for buf in self.buffers:
            if buf.rep.size > 1:
                shards = (
                    [buf.grad_shard]
                    if buf.grad_shard is not None
                    else [buf.owned_grad(b) for b in buf.buckets]
                )
                all_reduce_tensors(shards, buf.rep)
            buf.widen_owned()  # bf16 reduction: the norm, clip and update read fp32 (no-op for fp32 grads)

    def final_grads(self) -> list[tuple[Placement, torch.Tensor]]:
        return self._owned_grads
