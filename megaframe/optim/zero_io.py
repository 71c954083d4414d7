"""ZeroOptimizer's checkpoint and figure side: the per-rank state segments a checkpoint writes and a load
reads into, the dp-gathered logical state and grads (tests, debugging), and the memory figures. A mixin of
zero.py's ZeroOptimizer (and so of zero3.py's), split off to keep the step path readable; it reads the
optimizer's buffers, states, `_buffer_of`/`_segs_of` maps, param gather and the rule's step counters. The
state's names are the update rule's (optim/update_rule.py) plus `master`, the fp32 copy ZeRO keeps."""

from __future__ import annotations

import torch
from torch import nn

from megaframe.optim.buffer import Bucket, FlatBuffer, has_storage
from megaframe.parallel import comm


class ZeroStateIO:
    """Checkpoint segments, gathered state and memory figures of a ZeroOptimizer (see the module doc)."""

    def _gather_bucket(self, buf: FlatBuffer, b: Bucket, what: str) -> dict[str, torch.Tensor]:
        """Full-bucket tensors gathered over dp (collective): 'state' -> the rule's state (+ master),
        'grad' -> the reduced grad. Only the last bucket is cached: checkpoints walk params bucket by
        bucket."""
        self.param_gather.wait()
        key = (id(buf), b.index, what)
        if self._gathered is not None and self._gathered[0] == key:
            return self._gathered[1]
        if what == "grad":
            self.make_grads()
            shards = {"grad": buf.final_grad(b)}
        else:
            self.make_state()
            st = self.states[self.buffers.index(buf)]
            shards = {k: _state_shard(buf, st, b, k) for k in st.state}
            if st.master is not None:
                shards["master"] = buf.state_shard(st.master, b)
        full = {}
        for k, shard in shards.items():
            full[k] = torch.empty(b.numel, dtype=shard.dtype, device=shard.device)
            comm.all_gather_flat(full[k], shard, buf.axis)
        self._gathered = (key, full)
        return full

    def _slice(self, p: nn.Parameter, what: str) -> dict[str, torch.Tensor]:
        buf = self._buffer_of.get(p)
        if buf is None:
            return {}
        b = buf.bucket_of[p]
        o = buf.offset[p] - b.start
        # the names p's kind holds (a rule may keep others on other params), the master, or the grad
        keep = set(self.rule.states_for(p.placement)) | {"master", "grad"}
        full = self._gather_bucket(buf, b, what)
        return {k: v[o : o + p.numel()].view(p.shape) for k, v in full.items() if k in keep}

    def state_segments(self, p: nn.Parameter) -> list[tuple[int, int, dict[str, torch.Tensor]]]:
        """This rank's segments of p's state, no collective: (first element of the flat local param,
        length, {the rule's state names[, master]: 1-D views of the flat state}). Checkpoints write these."""
        buf = self._buffer_of.get(p)
        if buf is None:
            return []
        self.make_state()  # a save before any step writes the zero state a step would start from
        st = self.states[self.buffers.index(buf)]
        out = []
        for seg, _ in self._segs_of.get(p, []):
            lo, n = seg.state_lo, seg.numel
            views = st.views(seg)
            if st.master is not None:
                views["master"] = st.master[lo : lo + n]
            out.append((seg.param_lo, n, views))
        return out

    def logical_state(self, p: nn.Parameter) -> dict[str, torch.Tensor]:
        """The rule's state (and the fp32 master of bf16 params) shaped like p's local tensor.
        Collective over dp: every dp rank must call it for the same params in the same order."""
        return self._slice(p, "state")

    def reduced_grad(self, p: nn.Parameter) -> torch.Tensor:
        """p's full-batch (dp-summed, clipped) fp32 grad after
        step(); collective over dp (tests, debugging)."""
        return self._slice(p, "grad")["grad"]

    def load_targets(self, p: nn.Parameter) -> tuple[list[tuple[int, int, dict[str, torch.Tensor]]], bool]:
        """Where a checkpoint's state of p is read to, in place (checkpoint/load.py): this rank's segments as
        state_segments gives them, and whether this optimizer keeps a master of p (else the saved master goes
        into p itself). Nothing of p's full local size is made: each rank reads its own segments only."""
        self._gathered = None
        self.param_gather.wait()  # a gather in flight would overwrite what is loaded
        self.make_state()  # the load writes into the rule's state (and master)
        buf = self._buffer_of.get(p)
        keeps_master = buf is not None and self.states[self.buffers.index(buf)].master is not None
        return self.state_segments(p), keeps_master

    @torch.no_grad()
    def loaded(self, p: nn.Parameter, kinds: set[str], step: int) -> None:
        """After load_targets' segments (the `kinds` the checkpoint held) and p were read: a master the
        checkpoint lacks is taken from the loaded p, the step counters set, and p's write is not mistaken for
        an outside one."""
        buf = self._buffer_of.get(p)
        if buf is None:
            return
        st = self.states[self.buffers.index(buf)]
        flat = p.detach().reshape(-1)
        # a freed ZeRO-3 block's master got the saved weights directly (param_home): p holds nothing to copy
        from_p = st.master is not None and "master" not in kinds and p.untyped_storage().nbytes() > 0
        for seg, weights in self._segs_of.get(p, []):
            if from_p:
                st.master[seg.state_lo : seg.state_lo + seg.numel].copy_(
                    flat[seg.param_lo : seg.param_lo + seg.numel]
                )
            self.update.set_step(weights, step)
        if p in self._seen:
            self._seen[p] = p._version  # the master just loaded is exact: do not re-read it from p

    def held_state(self) -> list[torch.Tensor]:
        """This rank's flat rule state and masters that have storage (made: make_state)."""
        return [t for st in self.states for t in st.tensors() if has_storage(t)]

    def memory_bytes(self) -> dict[str, int]:
        """This rank's persistent grads in their dtype (zero=1: the buffer; zero=2: its shard, plus the acc
        of late buckets), optimizer state (moments + master for its range), and the peak of zero=2's
        transient bucket-sized grads. mem/grads_fp32_bytes: bf16 reduction's grad32, the fp32 copy of the
        owned range (4 bytes per owned element; 0 with fp32 grads), alive only from the reduction to the
        next zero_grad, when the activations are already freed: not part of mem/grads_bytes. Grads and state
        count only once made (make_grads / make_state): before, the rank holds none (training/phase_meter.py's
        baseline of a phase is what is held then)."""
        grads = sum(
            held(buf.grad) + held(buf.grad_shard) + sum(held(b.acc) for b in buf.buckets if b.late)
            for buf in self.buffers
        )
        optim = sum(held(t) for t in self.held_state())
        wide = sum(4 * buf.state_numel for buf in self.buffers if buf.grad32 is not None)
        return {
            "mem/grads_bytes": grads,
            "mem/optim_bytes": optim,
            "mem/gathered_peak_bytes": self.gathered_peak,
            "mem/grads_fp32_bytes": wide,
        }


def _state_shard(buf: FlatBuffer, st, b: Bucket, k: str) -> torch.Tensor:
    """This rank's share of bucket b of state `k`, laid out as the master (zeros where a param holds no k)."""
    if k not in st.at:
        return buf.state_shard(st.state[k], b)
    share = b.shard_numel(buf.dp_size)
    out = torch.zeros(share, dtype=st.state[k].dtype, device=st.state[k].device)
    for seg in buf.segments:
        lo = st.at[k].get(id(seg))
        if lo is not None and b.state_lo <= seg.state_lo < b.state_lo + share:
            out[seg.state_lo - b.state_lo :][: seg.numel].copy_(st.state[k][lo : lo + seg.numel])
    return out


def held(t: torch.Tensor | None) -> int:
    """Bytes t holds now: 0 for None or a lazy tensor not made yet."""
    return t.numel() * t.element_size() if t is not None and has_storage(t) else 0
