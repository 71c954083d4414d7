"""Which layers each pipeline rank holds.

Virtual stage s = chunk·pp + rank holds a contiguous block of layers: an even split of num_layers
over pp·vpp stages, or the explicit per-stage counts of `parallel.pp_layout`. Stage 0 also holds the
embedding; the last stage the final norm, the output head and the loss. Under zbv (`v`) the stages sit
in a V instead (schedule.stage_of): rank r holds stage r as chunk 0 and stage 2·pp-1-r as chunk 1, so
rank 0 holds both ends (embedding and head: a tied embedding is one tensor there, no copy to sum).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence

from megaframe.pipeline.grouping import build_schedule
from megaframe.pipeline.schedule import check_args, is_v, splits_backward, stage_of


@dataclass(frozen=True)
class Stage:
    """This rank's part of the model: the global layer indices of each of its chunks."""

    chunks: tuple[tuple[int, ...], ...]
    first: bool
    """Holds stage 0 (chunk 0 starts with the embedding)."""
    last: bool
    """Holds the last stage (the last chunk ends with the head and loss)."""
    v: bool = False
    """Chunks placed in a V (zbv): chunk 1 of rank r is stage 2·pp-1-r."""

    @staticmethod
    def whole(num_layers: int) -> "Stage":
        return Stage((tuple(range(num_layers)),), True, True)


def stage_counts(num_layers: int, pp: int, vpp: int, layout: Optional[Sequence[int]] = None) -> list[int]:
    """Layers per virtual stage; raises ValueError naming the setting when impossible."""
    stages = pp * vpp
    if layout:
        counts = list(layout)
        if len(counts) != stages or sum(counts) != num_layers or min(counts) < 0:
            raise ValueError(
                f"parallel.pp_layout={counts} must give {stages} non-negative layer counts "
                f"(pp x vpp) summing to model.num_layers={num_layers}"
            )
        return counts
    if num_layers % stages:
        raise ValueError(
            f"model.num_layers={num_layers} is not divisible by parallel.pp x parallel.vpp={stages}; "
            "set parallel.pp_layout for an uneven split"
        )
    return [num_layers // stages] * stages


def stage_layout(
    num_layers: int, pp: int, vpp: int, rank: int, layout: Optional[Sequence[int]] = None, v: bool = False
) -> Stage:
    counts = stage_counts(num_layers, pp, vpp, layout)
    # Every rank computes the whole table from the same config, so neighbouring stages agree on where
    # one chunk ends and the next begins without exchanging anything.
    starts = [sum(counts[:s]) for s in range(len(counts))]
    stages = [stage_of(rank, c, pp, v) for c in range(vpp)]
    chunks = tuple(tuple(range(starts[s], starts[s] + counts[s])) for s in stages)
    # first/last go by rank, not chunk: under vpp rank 0 holds stage 0 and rank pp-1 the last stage (in a
    # V, rank 0 both).
    return Stage(chunks, first=rank == 0, last=stage_of(rank, vpp - 1, pp, v) == pp * vpp - 1, v=v)


def check_runnable(
    kind: str,
    pp: int,
    vpp: int,
    m: int,
    moe: bool = False,
    recompute: str = "none",
    counts: list[int] | None = None,
    build: bool = True,
) -> None:
    """Raise ValueError (naming the settings) for what the executor cannot run: what check_args refuses, what
    building every rank's schedule refuses (the same build_schedule the executor runs), a pipeline rank left
    without any parameter by the layers per virtual stage `counts`, and the model settings the split backward
    does not compose with. The config checks call it before any rank starts; `build=False` leaves the
    schedules unbuilt (the planner's search: train.py builds them in full for the layout a user runs)."""
    check_args(kind, pp, vpp, m)
    if counts is not None:
        last = pp * vpp - 1
        for rank in range(pp):
            stages = [stage_of(rank, c, pp, is_v(kind)) for c in range(vpp)]
            # the embedding lives on stage 0 and the head on the last one: any other rank needs a layer
            if not any(counts[s] or s in (0, last) for s in stages):
                raise ValueError(
                    f"parallel.pp_layout={list(counts)} leaves pipeline rank {rank} (stages "
                    f"{stages} under {kind}) without any layer or parameter: give it a layer"
                )
    if splits_backward(kind) and moe and recompute == "full":
        # the recomputed MoE block's saved tensors are read
        # again by W after B released them (pipeline/split.py)
        raise ValueError(
            f"parallel.pp_schedule={kind} splits each backward in two and does not compose with an "
            "MoE model under train.recompute=full: use train.recompute=selective or none, or another "
            "parallel.pp_schedule"
        )
    if splits_backward(kind) and recompute == "op_selective":
        # W re-runs the checkpointed block in a second graph task, and torch hands the selective
        # checkpoint's kept outputs out once (to B's re-run): W's re-run would fail at step 1
        raise ValueError(
            f"parallel.pp_schedule={kind} splits each backward in two and does not compose with "
            "train.recompute=op_selective: use train.recompute=full, selective or none, or another "
            "parallel.pp_schedule"
        )
    if build:
        _buildable(kind, pp, vpp, m)


# Cached: the planner's search validates tens of thousands of layouts that share a few hundred schedules
@functools.lru_cache(maxsize=None)
def _buildable(kind: str, pp: int, vpp: int, m: int) -> None:
    for rank in range(pp):
        build_schedule(kind, pp, vpp, m, rank)
