"""The planner's memory per phase of a run: start-up, the first step, a save and the load of a resume, the
peak of each on one rank (what training/phase_meter.py measures and logs as mem/phase/<name>_peak_bytes).

A layout fits only if every phase fits: the steady step is not the only moment a rank may run out.
Modelled for how start-up, save and load work once parameters are built on the meta device:

  resident  params + grads + optimizer state as the trainer holds them between steps (rank_state.state_bytes)
  startup   params + (bf16 runs) INIT_FP32_TENSORS of the rank's largest local tensors in fp32 (a
            parameter's initial values are drawn in fp32, then cast into its shard); nothing else is ever
            whole. ZeRO-3 draws each owned segment instead (its fp32 rows and their cast); ZeRO-1/2 copy the
            drawn params into their param buffer (twice the params at once); zero=0 holds only the params and
            the init block being drawn. No optimizer holds grads or moments yet: they come with the first
            backward and update (torch's AdamW; ZeRO's lazy buffers, optim/buffer.py lazy_zeros)
  step      resident + the activations at the schedule's peak + on the last stage the head's fp32 logits
            and their gradient for one chunk of tokens (HEAD_FP32_COPIES of [tokens, V/tp], fp32 on the cpu;
            in the params' dtype on a GPU, at most layers.fused_ce's CHUNK_ELEMS there).
            ZeRO-3 (step_terms): the larger of the forward's end (the activations' peak, the output unit
            gathered, the head's workspace) and the backward of the stage's last block at its first weight
            grad, which holds the most transients at once: that block and the prefetched one before it
            gathered (STEP_GATHERED_BLOCKS), the output unit's grad bucket still reduce-scattering (zero.py
            _drain keeps the newest in flight) beside the block's own bucket filling, the weight grad
            autograd hands the hook before it is folded in, and every activation but the output step's
            (freed by its backward). On gloo (the cpu) each collective also stages a copy: an all-gather its
            whole output (the prefetched block), a reduce-scatter its whole input (the clone c10d's
            _reduce_scatter_base_ makes of the output unit's bucket); NCCL works in place.
            ZeRO-1 on gloo: the reduce-scatters clone every grad bucket when launched in the last backward,
            held to step()'s wait (resident + the grads, at the backward's end); after the update the param
            all-gathers stage their whole output (resident + the params). A clone gloo's worker thread still
            holds after the wait may overlap that staging: timing, not planned.
  save      resident + in host memory the copy of what this rank writes (its share of the params and its
            owned optimizer state, taken before the write so training may go on). ZeRO-3 gathers nothing
            (each rank writes its owned segments, zero3.weight_segments).
  load      resident less the grads (not made before a backward) + one staging buffer per file read, of the
            largest range this rank reads into one destination (its whole local tensor; under ZeRO its owned
            segment of the moments, and of everything at zero=3), at most checkpoint/store.py's STAGING_BYTES;
            the range is read into it on the host, then cast and copied into the parameter or the optimizer's
            flat segment. That is a resume under the layout that saved it (a requeued run); a checkpoint of
            another tp layout may stage longer ranges (rows another layout split), never past STAGING_BYTES.

On a GPU the host copies are host memory (RankFigures' host figures); when the run's device is the cpu
(`on_host`) they are the same memory and count in the phase's peak.

and, for comparison, start-up and load as they were before (`today_startup`, `today_load`): every rank
built its whole local (tp·pp) model in fp32 and cast it, ZeRO-3 copying the whole local params into its
flat buffer and cloning them per bucket before sharding; a resume allocated full local-shape tensors of
the weights and every optimizer state. Every constant is one number to adjust.
"""

from __future__ import annotations

from dataclasses import dataclass

from megaframe.checkpoint.store import STAGING_BYTES as LOAD_STAGING_BYTES  # the loader's own bound
from megaframe.layers.shard import BLOCK_EDGE

INIT_FP32_TENSORS = 1
"""Whole local tensors start-up holds in fp32 at once while it initialises a low-precision run (one
parameter at a time: drawn in fp32, then cast); an fp32 run draws straight into the parameter."""
INIT_BLOCK_BYTES = 4 * BLOCK_EDGE**2
"""The fp32 init block being drawn (layers/shard.py init_region), beside the params at zero=0's start-up (at
zero=1/2 the param buffer the params are copied into is larger)."""
STEP_GATHERED_BLOCKS = 2
"""ZeRO-3 blocks gathered at once in a step: the one running and the one prefetched."""
HEAD_FP32_COPIES = 2
"""fp32 [tokens, V/tp] tensors the head and loss hold at once: the logits and their gradient."""
HEAD_CHUNK_ELEMS = {"cpu": 1 << 26, "cuda": 1 << 30}
"""Logits per chunk of layers.fused_ce's head: on a GPU its memory budget (fused_ce.CHUNK_ELEMS, one chunk at
4k tokens x a 128k vocab), whose compiled softmax chain holds the logits and their grad in the params' dtype;
on the cpu (gloo) the eager chain's two fp32 copies, capped at the old GPU figure (the cpu's own 2^21 chunk is
smaller: the measured phases stay under this plan)."""


@dataclass(frozen=True)
class RankShape:
    """What the phase model reads of one rank, besides its resident state."""

    local_numel: int
    """Elements of the rank's whole local (tp/pp/ep) model, before any ZeRO sharding."""
    largest_numel: int
    """Elements of its largest local tensor."""
    block_bytes: int
    """Bytes of its largest transformer block's params in the run's dtype (what a ZeRO-3 gather holds)."""
    param_elem: int
    """Bytes per parameter element in the run's dtype."""
    shard: int
    """Ranks the optimizer state is sharded over (cp·dp, HSDP's shard group; 1 at zero=0)."""
    writers: int
    """Ranks a replicated parameter's checkpoint write is split over (cp·dp)."""
    zero: int
    head_logits: int = 0
    """Elements of one micro-batch's logits on this rank ([mb·S/cp, V/tp]); 0 without the head."""
    blocks_bytes: int = 0
    """Bytes of all its blocks' params in the run's dtype
    (today's ZeRO-3 keeps them gathered after start-up)."""
    grad_elem: int = 4
    """Bytes per element of the ZeRO grad buckets (2 under optim.grad_reduce_dtype=bf16)."""
    out_numel: int = 0
    """Elements of the output unit (final norm and head) on the last stage; 0 elsewhere."""
    out_acc: bool = True
    """The output unit's grad bucket is reduced in the backward (False: a tied embedding's, kept whole for
    the step and counted in the grads)."""
    block_param_numel: int = 0
    """Elements of the largest parameter of a block (its weight grad, handed to the hook before folding)."""
    head_act: int = 0
    """Bytes the output step saves for backward per micro-batch (freed before the blocks' backward)."""
    read_bytes: int = 0
    """Bytes of the largest range the rank loads into one destination (0: its largest tensor in fp32)."""
    gloo: bool = False
    """Collectives run on gloo (the cpu), which stages a copy of each (module doc)."""
    reshard: bool = True
    """ZeRO-3 frees a unit's gathered params after its forward (optim.reshard_after_forward)."""
    head_kind: str = "fused"
    """How the loss meets the logits (head_kind()): fused | whole | vocab_parallel."""


def written_bytes(s: RankShape, optim_bytes: int) -> int:
    """Bytes this rank writes to a checkpoint: its share of the local params in their dtype, and its
    optimizer state (ZeRO: its owned segments; zero=0: its share of the replicated moments)."""
    params = s.local_numel * s.param_elem // s.writers
    # ZeRO-3 counts the fp32 master of its owned range as
    # params; a low-precision run writes it as optim/master
    master = 4 * s.local_numel // s.shard if s.zero == 3 and s.param_elem != 4 else 0
    return params + master + (optim_bytes if s.zero else optim_bytes // s.writers)


def staging_bytes(s: RankShape) -> int:
    """The load's staging buffer: the largest range read into one destination, at most LOAD_STAGING_BYTES."""
    return min(LOAD_STAGING_BYTES, s.read_bytes or 4 * s.largest_numel)


def phase_peaks(
    s: RankShape, params: int, grads: int, optim: int, activations: int, on_host: bool = False
) -> dict[str, int]:
    """{startup, step, save, load} peak bytes of one rank's device (module doc); `on_host`: the device is
    the host (cpu runs), so the save's host copy and the load's host staging count too."""
    resident = params + grads + optim
    init = INIT_FP32_TENSORS * 4 * s.largest_numel if s.param_elem != 4 else 0
    if (
        s.zero == 3
    ):  # drawn per owned segment (zero3.init_flat): its fp32 rows (and their cast) and the init block
        cast = s.param_elem if s.param_elem != 4 else 0
        init = (4 + cast) * (s.read_bytes // 4 or s.largest_numel // s.shard) + INIT_BLOCK_BYTES
    host = host_peaks(s, optim) if on_host else {"save": 0}
    step = sum(step_terms(s, params, grads, optim, activations).values())
    # No optimizer keeps grads until a backward nor moments until the first update (or a load reads them):
    # zero=0 is torch's AdamW, ZeRO makes its buffers lazily (optim/buffer.py lazy_zeros). ZeRO-1/2 copy the
    # drawn params into their param buffer (both whole at once, the first copy freed per param); ZeRO-3 draws
    # its segments straight into its master (its params).
    startup = {0: params + max(init, INIT_BLOCK_BYTES), 3: params + init}.get(
        s.zero, max(params + init, 2 * params)
    )
    return {
        "startup": startup,
        "step": step,
        "save": resident + host["save"],
        # on a GPU the staged range's device copy; on the cpu the staging buffer itself: one of either
        "load": resident - grads + staging_bytes(s),
    }


def head_kind(tp: int, fused_head_loss: bool) -> str:
    """The loss path the model runs (model/gpt.py _head_output): the fused head + loss at tp=1 unless
    train.fused_head_loss=false (the whole logits), the vocab-parallel loss under tp > 1."""
    if tp > 1:
        return "vocab_parallel"
    return "fused" if fused_head_loss else "whole"


def head_transient_bytes(s: RankShape) -> int:
    """The head and loss's bytes beyond what the loss saves for backward (that is in the activations: the
    meta forward counts it), at the forward's moment that holds the most (module doc's step):
      fused           one chunk's fp32 logits and grad (HEAD_CHUNK_ELEMS; on a GPU in the params' dtype)
      whole           the logits in the params' dtype and their fp32 copy, beside the fp32 log-softmax
                      being written (saved); an fp32 run's copy is the logits themselves
      vocab_parallel  the logits and their max-shifted copy in the params' dtype, beside the exp being
                      written (saved, then divided in place into the softmax)
    The backward of either unfused path works in place over the saved tensor, then casts it to the
    params' dtype: one copy of the logits, never more than the forward's."""
    if not s.head_logits:
        return 0
    if s.head_kind == "whole":
        return s.head_logits * (s.param_elem + (4 if s.param_elem != 4 else 0))
    if s.head_kind == "vocab_parallel":
        return 2 * s.param_elem * s.head_logits
    if s.gloo:
        return HEAD_FP32_COPIES * 4 * min(s.head_logits, HEAD_CHUNK_ELEMS["cpu"])
    return HEAD_FP32_COPIES * s.param_elem * min(s.head_logits, HEAD_CHUNK_ELEMS["cuda"])


def step_terms(s: RankShape, params: int, grads: int, optim: int, activations: int) -> dict[str, int]:
    """The step's peak as named terms (their sum is the step phase; `python -m megaframe.plan` prints them):
    at zero < 3 the state, the activations and the head's transient; ZeRO-3 (module doc) the larger of the
    forward's end and the last block's backward, each with what it holds gathered or in flight."""
    resident = params + grads + optim
    head = head_transient_bytes(s)
    if s.zero != 3:
        terms = {"resident state": resident, "activations": activations, "logits/loss transient": head}
        if s.zero == 1 and s.gloo:  # gloo's copies of ZeRO-1's collectives (module doc), one after the other
            terms["gloo collective copies"] = max(0, max(grads, params) - activations - head)
        return terms
    return max(
        zero3_forward(s, resident, activations, head),
        zero3_backward(s, resident, activations),
        key=lambda t: sum(t.values()),
    )


def zero3_forward(s: RankShape, resident: int, activations: int, head: int) -> dict[str, int]:
    """ZeRO-3 at the forward's end: the output unit gathered beside the head's transient; without
    optim.reshard_after_forward every unit the forward gathered is still gathered."""
    kept = s.blocks_bytes if not s.reshard else 0
    return {
        "resident state": resident,
        "activations": activations,
        "zero3 gathered: output unit": s.param_elem * s.out_numel,
        "zero3 kept gathered (no reshard)": kept,
        "logits/loss transient": head,
    }


def zero3_backward(s: RankShape, resident: int, activations: int) -> dict[str, int]:
    """ZeRO-3 at the last block's first weight grad: that block and the prefetched one gathered (all blocks
    without reshard_after_forward), the output unit's bucket still reduce-scattering, the block's own bucket
    filling, and the weight grad before it is folded in; the output step's activations are freed."""
    block_numel = s.block_bytes // s.param_elem
    out_acc = s.grad_elem * s.out_numel if s.out_acc else 0
    gathered = STEP_GATHERED_BLOCKS * s.block_bytes if s.reshard else max(s.blocks_bytes, s.block_bytes)
    terms = {
        "resident state": resident,
        "activations": activations - s.head_act,
        "zero3 gathered: running + prefetched blocks": gathered,
        "zero3 reduce-scatter in flight (output unit)": out_acc,
        "zero3 grad bucket filling (block)": s.grad_elem * block_numel,
        "weight grad before folding": s.param_elem * s.block_param_numel,
    }
    if s.gloo:  # the prefetched block's all-gather output and the output bucket's reduce-scatter input
        terms["gloo collective copies"] = s.block_bytes + out_acc
    return terms


def host_peaks(s: RankShape, optim: int) -> dict[str, int]:
    """Host bytes a save and a load add (beyond the process itself): the save's copy of what the rank
    writes, the load's staging buffer."""
    return {"save": written_bytes(s, optim), "load": staging_bytes(s)}


def today_startup(s: RankShape, params: int, grads: int, optim: int) -> int:
    """Start-up before meta-device init (module doc): the whole local model in fp32 while each tensor is
    cast, then the local params in their dtype with the optimizer's grads and state (ZeRO-3: its flat
    buffer and the per-bucket clones, both whole, beside the fp32 master shard)."""
    build = 4 * s.local_numel + (s.param_elem * s.largest_numel if s.param_elem != 4 else 0)
    local = s.local_numel * s.param_elem
    if s.zero == 3:
        return max(build, 2 * local + grads + optim + 4 * s.local_numel // s.shard)
    return max(build, local + grads + optim)


def today_load(s: RankShape, resident: int, master: bool) -> int:
    """A resume before shard-wise reads: full local-shape tensors of the weights (their checkpoint dtype,
    taken as the run's), both fp32 moments and (bf16 or ZeRO-3) the fp32 master, beside the resident state
    (ZeRO-3: with its blocks still gathered from start-up)."""
    gathered = s.blocks_bytes if s.zero == 3 else 0
    return resident + gathered + s.local_numel * (s.param_elem + 8 + (4 if master else 0))


def largest_phase(peaks: dict[str, int]) -> str:
    return max(peaks, key=peaks.get)
