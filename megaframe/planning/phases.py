"""The planner's memory per phase of a run: start-up, the first step, a save and the load of a resume, the
peak of each on one rank (what training/phases.py measures and logs as mem/phase/<name>_peak_bytes).

A layout fits only if every phase fits: the steady step is not the only moment a rank may run out.
Modelled for how start-up, save and load work once parameters are built on the meta device (issue 24):

  resident  params + grads + optimizer state as the trainer holds them between steps (estimate.state_bytes)
  startup   resident + (bf16 runs) INIT_FP32_TENSORS of the rank's largest local tensors in fp32 (a
            parameter's initial values are drawn in fp32, then cast into its shard); nothing else is ever whole
  step      resident + the activations at the schedule's peak + ZeRO-3's gathered blocks in flight
            (STEP_GATHERED_BLOCKS: the running block and the prefetched one, in the run's dtype) + on the
            last stage the head's fp32 logits and their gradient for one chunk of tokens (HEAD_FP32_COPIES
            of [tokens, V/tp], at most layers.fused_ce's CHUNK_ELEMS on a GPU)
  save      resident + ZeRO-3's gathered blocks (SAVE_GATHERED_BLOCKS: the save gathers one block at a
            time); in host memory the copy of what this rank writes (its share of the params and its owned
            optimizer state, taken before the write so training may go on)
  load      resident + one staging buffer of at most LOAD_STAGING_BYTES (a range is read into it on the
            host, then cast and copied into its destination, the parameter or the optimizer's flat
            segment, through a device copy of the same size)

On a GPU the host copies are host memory (RankFigures' host figures); when the run's device is the cpu
(`on_host`) they are the same memory and count in the phase's peak.

and, for comparison, start-up and load as they were before (`today_startup`, `today_load`): every rank
built its whole local (tp·pp) model in fp32 and cast it, ZeRO-3 copying the whole local params into its
flat buffer and cloning them per bucket before sharding; a resume allocated full local-shape tensors of
the weights and every optimizer state. Every constant is one number to adjust.
"""
from __future__ import annotations

from dataclasses import dataclass

LOAD_STAGING_BYTES = 256 * 2**20
"""The resume's one bounded staging buffer (a range read from a file before it is copied into its shard)."""
INIT_FP32_TENSORS = 1
"""Whole local tensors start-up holds in fp32 at once while it initialises a low-precision run (one
parameter at a time: drawn in fp32, then cast); an fp32 run draws straight into the parameter."""
STEP_GATHERED_BLOCKS = 2
"""ZeRO-3 blocks gathered at once in a step: the one running and the one prefetched."""
SAVE_GATHERED_BLOCKS = 1
"""ZeRO-3 blocks a save gathers at once."""
HEAD_FP32_COPIES = 2
"""fp32 [tokens, V/tp] tensors the head and loss hold at once: the logits and their gradient."""
HEAD_CHUNK_ELEMS = 1 << 26
"""layers.fused_ce's logits per chunk on a GPU: the head's workspace never exceeds it."""


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
    """Bytes of all its blocks' params in the run's dtype (today's ZeRO-3 keeps them gathered after start-up)."""


def written_bytes(s: RankShape, optim_bytes: int) -> int:
    """Bytes this rank writes to a checkpoint: its share of the local params in their dtype, and its
    optimizer state (ZeRO: its owned segments; zero=0: its share of the replicated moments)."""
    params = s.local_numel * s.param_elem // s.writers
    return params + (optim_bytes if s.zero else optim_bytes // s.writers)


def staging_bytes(s: RankShape) -> int:
    """The load's staging buffer: LOAD_STAGING_BYTES, or less where no tensor is that large (fp32 read)."""
    return min(LOAD_STAGING_BYTES, 4 * s.largest_numel)


def phase_peaks(s: RankShape, params: int, grads: int, optim: int, activations: int,
                on_host: bool = False) -> dict[str, int]:
    """{startup, step, save, load} peak bytes of one rank's device (module doc); `on_host`: the device is
    the host (cpu runs), so the save's host copy and the load's host staging count too."""
    resident = params + grads + optim
    gathered = s.block_bytes if s.zero == 3 else 0
    init = INIT_FP32_TENSORS * 4 * s.largest_numel if s.param_elem != 4 else 0
    host = host_peaks(s, optim) if on_host else {"save": 0}
    return {"startup": resident + init,
            "step": resident + activations + STEP_GATHERED_BLOCKS * gathered
            + HEAD_FP32_COPIES * 4 * min(s.head_logits, HEAD_CHUNK_ELEMS),
            "save": resident + SAVE_GATHERED_BLOCKS * gathered + host["save"],
            # on a GPU the staged range's device copy; on the cpu the staging buffer itself: one of either
            "load": resident + staging_bytes(s)}


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
