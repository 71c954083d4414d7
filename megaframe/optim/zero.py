"""ZeRO-1 and ZeRO-2 distributed optimizer (and HSDP): dp-sharded update-rule state (ZeRO-2: and grads),
bucketed reduce-scatters overlapped with backward.

Sharding (see buffer.py for the layout): every parameter lives in a contiguous param buffer and its
fp32 gradient in a grad buffer of the same layout, cut into buckets. dp rank r owns the r-th 1/dp of
every bucket. It keeps the update rule's state (optim/update_rule.py) only for that range: the rule's
per-element state and, for bf16 params, an fp32 master copy (fp32 params are their own master: the update
writes the param buffer in place). So optimizer state per rank is the rule's bytes per element (AdamW: 8),
plus 4 for bf16 params, per owned element: 1/dp of the whole.

One step, zero=1:
  backward     grads accumulate in place into the grad buffer: the linears' weight-grad GEMMs (and the
               fused head's dW) write into the slice, p.main_grad, themselves (layers/wgrad.py); other
               params' grads are copied (first micro-batch of the step) or added into it by a post-accumulate
               hook, which frees a separate low-precision grad (fp32 params: p.grad then *is* the slice).
               Inside backward_context(is_last=True) the same hook marks the param
               ready; the hook that completes a bucket launches its async reduce-scatter over dp, so
               communication of the last layers' grads runs while earlier layers still compute.
  step(lr)     optim/finalize.py's one path, with this optimizer as its GradSource: sum the tied
               embedding over the pipeline ends (its bucket is `late`: never launched from backward),
               launch what backward did not (buckets with an unused param, or late ones), wait for
               everything in flight, sum tp-partial grads over tp (sequence-parallel norms: on this
               rank's range only), global grad norm; then the rule's step on the owned range, clipping as its
               grad_scale, and the
               all-gather of the updated param buckets over dp.
zero=2 keeps no grad buffer (buffer.py): in EVERY micro-batch's backward the hook adds p.grad into its
bucket's `acc` (allocated on the bucket's first grad) and frees p.grad; the hook completing a bucket
launches its reduce-scatter in place on acc, and once that has landed (waited for when the next bucket
is launched, or at the end of the micro-batch's backward) this rank's part is added into grad_shard and
acc is freed. So at most about two buckets of full-size grads exist at once (mem/gathered_peak_bytes),
and the dp traffic is one reduce-scatter per micro-batch instead of one per step. A bucket left
incomplete at the end of a micro-batch (a param without a grad, a bucket spanning two vpp chunks) is
reduce-scattered then, in bucket order. Every dp rank must use the same params in a micro-batch (they
run the same model), or their collectives would not match.

HSDP (optim.shard_group_size = s < dp): the axis sharded over is mesh.dp_shard (s consecutive dp ranks);
after the reduce-scatters, this rank's reduced shard is all-reduced over mesh.dp_rep (the dp/s ranks
holding the same shard) once per step, and the param all-gather runs within the shard group.

Under context parallelism "dp" in all of this is the cp·dp ranks (mesh.dpcp): cp ranks hold the same
params and their grads are partial sums over their own tokens, so the dense buffers shard and reduce
over cp·dp (Megatron's dp-cp group), and HSDP cuts that axis into shard groups (mesh.py says how).
Nothing here knows about cp: the mesh hands it dp_shard = dpcp (or its HSDP blocks).

The param all-gather after the update is overlapped with the next forward (optim.overlap_param_gather,
see param_gather.py): step() launches it bucket by bucket and each module's forward pre-hook waits for
the buckets it needs. Readers of parameters outside a forward call sync_params() first.

Grad norm: each element is counted once. Ranges are disjoint over the shard axis, so squares are summed
over it; over tp and pp `Placement.counts_in_norm` drops tp-replicated copies on tp ranks > 0 and pipeline
duplicates.
The buffers and the rule's state over the owned range are built in zero_state.py.

optim.grad_reduce_dtype=bf16 (bf16 params only): the grad buffer, grad_shard and the buckets' acc are
bf16, so "fp32" above reads "bf16" for everything up to the reduction (zero=1 bf16 params then accumulate
straight into the buffer, as fp32 ones do); the reduce-scatters and HSDP's all-reduce send half the bytes.
reduce_data_parallel then widens the owned range into the buffer's grad32 (fp32) and the tp sum, norm,
clip and AdamW read that. No extra scaling is needed: the loss is divided by the global token count, so
what is summed is already each rank's share of the mean (Megatron scales by 1/dp before its bf16 reduce
for the same reason: a sum of already-averaged values keeps the magnitude of one).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from megaframe.config.schema import OptimConfig
from megaframe.layers import wgrad
from megaframe.layers.vocab import VocabParallelEmbedding
from megaframe.optim.buffer import Bucket, FlatBuffer, grad_dtype, widens_grads
from megaframe.optim.finalize import all_reduce_tensors, clip_divisor, finalize
from megaframe.optim.param_gather import ParamGather
from megaframe.optim.protocol import Optimizer
from megaframe.optim.rule_registry import rule_named
from megaframe.optim.zero_io import ZeroStateIO
from megaframe.optim.zero_state import build_state, flat_buffers, make_state
from megaframe.parallel import comm
from megaframe.parallel.mesh import Axis, Mesh
from megaframe.parallel.placement import Placement


class ZeroOptimizer(ZeroStateIO, Optimizer):
    """optim/protocol.py's Optimizer with ZeRO-1 or -2 (cfg.zero) sharding over mesh.dp_shard (= dp
    unless HSDP; expert params: over mesh.edp). Also the finalize.GradSource of its step: grads
    reduce-scattered, so `sharded`.

    overlap=False launches every reduce-scatter in step() instead of from backward hooks (benchmarks).
    """

    def __init__(self, model: nn.Module, cfg: OptimConfig, mesh: Mesh, overlap: bool = True):
        self.model, self.cfg, self.mesh, self.overlap = model, cfg, mesh, overlap
        self.stage = 2 if cfg.zero >= 2 else 1
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = flat_buffers(self.params, cfg, mesh, self._make_buffer)
        self._buffer_of = {p: buf for buf in self.buffers for p in buf.offset}
        self._last = False
        self._pending: list[tuple[FlatBuffer, Bucket]] = []  # zero=2: reduce-scatters not yet added in
        self._acc_bytes = self.gathered_peak = 0  # zero=2: live bucket-sized grads now, and their peak
        self._gathered: tuple | None = None  # (key, {name: full bucket tensor}) of the last gathered bucket
        self.rule = rule_named(cfg.name)
        self.states, self._segs_of, self.update, self._owned_grads = build_state(
            self.buffers, self.rule, cfg, mesh.device, self.always_master, self._segment_values, mesh
        )
        self._casts: dict | None = None  # per bucket: (master ranges to cast, those the step writes)
        self._seen = {p: p._version for p in self._segs_of if p.dtype != torch.float32 or self.always_master}
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]
        self.param_gather = self._make_param_gather(model)
        # Grads get their storage at the first zero_grad or grad hook, moments at the first zero_grad, step,
        # save or load (make_grads / make_state): start-up holds the params only, as torch's AdamW (zero=0).
        self._grads_made = False
        self._clear_grads()

    always_master = False
    """Keep the owned range of fp32 params in a separate fp32 tensor too (zero=3: the param buffer is
    not kept whole, so the update cannot write it in place)."""

    _segment_values = None
    """zero=3: a segment's starting values (its buffers keep no whole param buffer to copy them from)."""

    def _make_buffer(
        self, params: list[nn.Parameter], bucket_bytes: int, axis: Axis, late: set
    ) -> FlatBuffer:
        return FlatBuffer(
            params,
            bucket_bytes,
            axis.rank,
            axis.size,
            late,
            sharded_grads=self.stage == 2,
            grad_dtype=self._grad_dtype(params),
            lazy_grads=True,
            widen=widens_grads(self.cfg),
        )

    def _grad_dtype(self, params: list[nn.Parameter]) -> torch.dtype:
        return grad_dtype(self.cfg.grad_reduce_dtype, params[0].dtype)

    def _make_param_gather(self, model: nn.Module):
        return ParamGather(model, self.buffers, self.cfg.overlap_param_gather)

    # ------------------------------------------------------------------ backward

    def make_grads(self) -> None:
        """Give the grads their storage (zeroed), once: at the first zero_grad, or the first grad hook of a
        backward run without one. A late bucket's params get their acc views (zero_grad's job after)."""
        if self._grads_made:
            return
        self._grads_made = True
        for buf in self.buffers:
            buf.alloc_grads()
        if self.stage == 1:
            # The grad buffer has its memory now: linears may write their weight grads into it
            # (layers/wgrad.py) not the embedding: its weight may be the tied head's too, and two grads of one
            # param are summed by autograd before its hook, where the never-written one would be added in.
            # An untied embedding adds its looked-up rows into the buffer itself (layers/vocab.py).
            embeds = {id(m.weight) for m in self.model.modules() if isinstance(m, VocabParallelEmbedding)}
            heads = {
                id(m.head_weight())
                for m in self.model.modules()
                if getattr(m, "output_step", None) is not None and hasattr(m, "head_weight")
            }
            for p in self.params:
                p.fuse_wgrad = id(p) not in embeds
                p.rows_into_main = id(p) in embeds and id(p) not in heads
        for buf in self.buffers:
            for b in buf.buckets:
                if self.stage == 2 and b.late and b.acc is None:
                    for p in b.params:
                        p.main_grad = buf.acc_view(p)

    def make_state(self) -> None:
        """Give the moments (and a master copied from the params) their storage, once: the first zero_grad,
        step, save or load."""
        make_state(self.buffers, self.states)

    def zero_grad(self) -> None:
        # The moments too, not only at the first update (torch's AdamW's time): made before the first
        # forward, the first step holds what every later one does, the step the planner sizes.
        self.make_grads()
        self.make_state()
        self._clear_grads()

    def _clear_grads(self) -> None:
        """zero_grad without making the grads (construction: they have no storage yet, nothing to clear)."""
        self._wait_all()
        self._acc_bytes = 0
        made = self._grads_made
        if self.stage == 1 and made:
            # Nothing to zero: each param's first grad of the step is written, not added (wgrad.py's GEMM, or
            # _grad_ready's copy); a param no backward reached is zeroed at step (_zero_unwritten).
            wgrad.forget(p.main_grad for p in self.params)
        for buf in self.buffers:
            if buf.grad_shard is not None and made:  # zero=2: reduce-scattered ranges are added into it
                buf.grad_shard.zero_()
            buf.free_grad32()
            for b in buf.buckets:
                b.ready.clear()
                b.launched = False
                b.acc = None
                # kept for the step: summed over the pipeline ends first
                if self.stage == 2 and b.late and made:
                    for p in b.params:
                        p.main_grad = buf.acc_view(p)
        for p in self.params:
            # the first backward's grad is separate; the hook writes it into the buffer (and for grads in the
            # param's dtype then points p.grad at the buffer slice, so later micro-batches accumulate there)
            p.grad = None

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

    # ------------------------------------------------------------------ step

    def step(self, lr: float) -> torch.Tensor:
        self._gathered = None
        self.param_gather.wait()  # a step with no forward since the last one (the master is re-read)
        self.make_state()
        self._resync_master()
        self._zero_unwritten()
        # the rule's step divides by the clip (one pass over the grads fewer: finalize.clip_divisor)
        norm = finalize(self, self.mesh, self.cfg.clip_grad, clip=False)
        if self.update is not None:
            # A NaN/Inf norm skips the update on the device, without a host sync. Every rank sees the same
            # global norm, so all skip together.
            self.update.step(lr, clip_divisor(norm, self.cfg.clip_grad), (~torch.isfinite(norm)).float())
        self.param_gather.launch(self._launch_param_gather)
        return norm

    @torch.no_grad()
    def _zero_unwritten(self) -> None:
        """zero=1: zero the grads of params no backward of this
        step reached (zero_grad left them as they were)."""
        if self.stage != 1 or not self._grads_made:
            return
        for p in self.params:
            if wgrad.note_written(p.main_grad):
                p.main_grad.zero_()

    @torch.no_grad()
    def _resync_master(self) -> None:
        """Low-precision params written from outside since we last saw them (a checkpoint without
        optimizer state, an HF import, a user's copy_) hand their values to the fp32 master, which
        would otherwise overwrite them at the next all-gather. Our own writes (the all-gather into
        the param buffer) do not move a param's version counter: it is not shared with the buffer."""
        for p, seen in self._seen.items():
            if p._version != seen:
                flat = p.detach().reshape(-1)
                for seg, weights in self._segs_of[p]:
                    weights.copy_(flat[seg.param_lo : seg.param_lo + seg.numel])
                self._seen[p] = p._version

    @torch.no_grad()
    def _launch_param_gather(self, buf: FlatBuffer, b: Bucket):
        """Owned range -> param buffer (cast from the fp32 master), then launch the bucket's all-gather."""
        mine = buf.shard(buf.param, b)
        st = self.states[self.buffers.index(buf)]
        if st.master is not None:
            # The cast to the params' dtype happens once, on the owned range, before the gather: ranks then
            # gather bf16, half the bytes of gathering the fp32 master. Ranges the step wrote in its own
            # pass (writes_low) are not cast again.
            casts = self._casts_of(b)
            if casts is None:
                mine.copy_(buf.state_shard(st.master, b))
            for w in casts or ():
                w.low.copy_(w)
        return comm.all_gather_flat(buf.bucket_range(buf.param, b), mine, buf.axis, async_op=True)

    def _casts_of(self, b: Bucket) -> list[torch.Tensor] | None:
        """The master ranges of bucket b the step left for the cast (None: all of them, the whole shard)."""
        if self._casts is None:
            self._casts = {}
            for segs in self._segs_of.values():
                for seg, w in segs:
                    bucket = self._buffer_of[seg.param].bucket_of[seg.param]
                    self._casts.setdefault(bucket, ([], []))[self.update.writes_low(w)].append(w)
        left, written = self._casts.get(b, ([], []))
        return None if not written else left

    def sync_params(self) -> None:
        """Wait for the parameter all-gathers still in flight (overlap_param_gather): call before reading
        parameters outside a forward (saving, copying them out)."""
        self.param_gather.wait()

    def settle(self) -> None:
        """Before a save: as sync_params (zero=3 overrides it: a save there gathers nothing)."""
        self.sync_params()
