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
The backward side (the hooks, zero=2's accumulation, bf16 grads, the GradSource) is zero_grads.py. A step
that writes the bf16 param range itself (optim.step_kernel=compiled: RuleStep.writes_low) leaves no cast
of the master for the all-gather (_launch_param_gather).

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
"""

from __future__ import annotations

import torch
from torch import nn

from megaframe.config.schema import OptimConfig
from megaframe.layers import wgrad
from megaframe.layers.vocab import VocabParallelEmbedding
from megaframe.optim.buffer import Bucket, FlatBuffer, grad_dtype, widens_grads
from megaframe.optim.finalize import clip_divisor, finalize
from megaframe.optim.param_gather import ParamGather
from megaframe.optim.protocol import Optimizer
from megaframe.optim.rule_registry import rule_named
from megaframe.optim.zero_grads import ZeroGradReduce
from megaframe.optim.zero_io import ZeroStateIO
from megaframe.optim.zero_state import build_state, flat_buffers, make_state
from megaframe.parallel import comm
from megaframe.parallel.mesh import Axis, Mesh


class ZeroOptimizer(ZeroGradReduce, ZeroStateIO, Optimizer):
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
