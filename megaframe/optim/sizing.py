"""What the ZeRO optimizers allocate and send, computed without allocating: the planner sizes every rank
of a layout with these on a virtual mesh, from the same `buffer_groups` and bucket plans the optimizers
(zero.py, zero3.py) build their buffers from."""

from __future__ import annotations

import torch
from torch import nn

from megaframe.config.schema import OptimConfig
from megaframe.optim.buffer import (
    bucket_plan,
    buffer_groups,
    grad_dtype,
    group_plan,
    replicas_of,
    widens_grads,
)
from megaframe.optim.float8_gather import split_groups
from megaframe.optim.param_gather import gather_units, gathers_per_step, zero3_groups
from megaframe.optim.rule_registry import rule_named
from megaframe.parallel.mesh import Mesh


def _float8(model: nn.Module | None, cfg: OptimConfig) -> set[int]:
    """ids of the weights zero=3 gathers as float8 (build_model's `float8_gathered`: an fp8 tensorwise
    run)."""
    return {id(p) for p in getattr(model, "float8_gathered", ())} if cfg.zero == 3 else set()


def _plans(params: list[nn.Parameter], cfg: OptimConfig, mesh: Mesh, model: nn.Module | None):
    """(shard axis, params, buffer order, bucket plan) per buffer, as the optimizer of cfg.zero lays them
    (zero=3 under fp8: a unit's float8 weights in a bucket of their own, float8_gather.split_groups)."""
    units = gather_units(model) if model is not None and cfg.zero == 3 else []
    f8 = _float8(model, cfg)
    for axis, ps in buffer_groups(params, mesh):
        if units:
            ordered, plan = group_plan(ps, split_groups(zero3_groups(ps, units), f8), axis.size)
        else:
            ordered, plan = bucket_plan(ps, int(cfg.bucket_size_mb * 2**20), axis.size)
        yield axis, ps, ordered, plan


def planned_memory_bytes(
    params: list[nn.Parameter], cfg: OptimConfig, mesh: Mesh, model: nn.Module | None = None
) -> dict[str, int]:
    """memory_bytes() of the ZeRO optimizer of `params` on this rank of `mesh` (zero=3 needs the `model`
    for its gather units' buckets): the same buffers and bucket padding, and per owned element the state
    zero_state.build_state keeps (the update rule's state bytes, plus an fp32 master for low-precision
    params). zero=3 adds mem/params_bytes: the fp32 owned range plus any bucket no gather unit reads (kept
    whole; none in a GPT).
    Grads take g bytes an element: 4, or 2 under optim.grad_reduce_dtype=bf16 for bf16 params
    (buffer.grad_dtype); then the step's fp32 copy of the owned range is mem/grads_fp32_bytes, 4 bytes per
    owned element."""
    units = gather_units(model) if model is not None and cfg.zero == 3 else []
    in_units = {id(p) for _, us, _ in units for p in us}
    grads = optim = params_bytes = wide = 0
    rule = rule_named(cfg.name)
    for axis, ps, ordered, plan in _plans(params, cfg, mesh, model):
        state = rule_state_bytes(rule, cfg.state_dtype, _owned(ordered, plan, axis.rank, axis.size))
        numel = plan[-1][2] if plan else 0
        late = sum(end - start for idx, start, end in plan if any(ordered[i].placement.pp_tied for i in idx))
        g = grad_dtype(cfg.grad_reduce_dtype, ps[0].dtype).itemsize
        wide += 4 * numel // axis.size if g != 4 and widens_grads(cfg) else 0
        if cfg.zero == 3:
            resident = sum(end - start for idx, start, end in plan if id(ordered[idx[0]]) not in in_units)
            grads += g * (numel // axis.size + late)  # a tied embedding's bucket: whole for the step
            optim += state
            params_bytes += 4 * numel // axis.size + resident * ps[0].element_size()
            continue
        if cfg.zero >= 2:  # the shard, plus the whole of late buckets (a tied embedding's)
            grads += g * (numel // axis.size + late)
        else:
            grads += g * numel
        optim += state + (numel // axis.size) * (0 if ps[0].dtype == torch.float32 else 4)
    out = {"mem/grads_bytes": grads, "mem/optim_bytes": optim, "mem/grads_fp32_bytes": wide}
    return {**out, "mem/params_bytes": params_bytes} if cfg.zero == 3 else out


def _owned(ordered: list[nn.Parameter], plan, rank: int, size: int) -> list[tuple[nn.Parameter, int]]:
    """(param, elements) of each segment `rank` of `size` owns (buffer.FlatBuffer's segments), and the
    rank's whole range's elements as (None, n) first."""
    out, total = [], 0
    for idx, start, end in plan:
        share = (end - start) // size
        lo, hi, at = start + rank * share, start + (rank + 1) * share, start
        total += share
        for i in idx:
            n = ordered[i].numel()
            if min(hi, at + n) > max(lo, at):
                out.append((ordered[i], min(hi, at + n) - max(lo, at)))
            at += n
    return [(None, total), *out]


def rule_state_bytes(rule, dtype: str, owned: list[tuple[nn.Parameter | None, int]]) -> int:
    """The bytes of zero_state's rule state over `owned` (_owned): a name every segment's param holds spans
    the whole range, padding included; another only the segments whose params hold it."""
    (_, total), segs = owned[0], owned[1:]
    out = 0
    for k, b in zip(rule.states, rule.state_bytes[dtype]):
        holders = [n for p, n in segs if k in rule.states_for(p.placement)]
        out += b * (total if len(holders) == len(segs) else sum(holders))
    return out


def planned_dp_bytes(
    params: list[nn.Parameter],
    cfg: OptimConfig,
    mesh: Mesh,
    microbatches: int,
    model: nn.Module | None = None,
) -> int:
    """Bytes this rank sends on dp in one step of the ZeroOptimizer of `params` (the planner; what
    comm_bytes/dp logs), from the same buffers: per bucket of n elements over a shard axis of s ranks, a
    reduce-scatter (s-1)/s·g·n (g: the grad bytes, 4 or 2 under bf16 reduction) once a step (zero=1) or per
    micro-batch (zero=2: exact with one pipeline chunk per rank; under vpp a bucket spanning two chunks is
    reduced once per chunk), the all-gather (s-1)·n/s params, under HSDP the all-reduce 2(r-1)/r·g·n/s of
    the shard over r replicas; plus the grad norm's scalar all-reduce over the dense shard axis. zero=3
    gathers each bucket around every use (param_gather.gathers_per_step: a block's twice per micro-batch,
    forward and backward; once per step without reshard_after_forward), the float8 weights' buckets at 1
    byte an element (fp8 tensorwise) plus their scales' all-reduce."""
    units = gather_units(model) if model is not None and cfg.zero == 3 else []
    total, f8 = 0, _float8(model, cfg)
    for axis, ps, ordered, plan in _plans(params, cfg, mesh, model):
        s, r = axis.size, replicas_of(axis, mesh).size
        g = grad_dtype(cfg.grad_reduce_dtype, ps[0].dtype).itemsize
        if any(id(p) in f8 for p in ps):  # the float8 weights' scales: one all-reduce(max) of fp32 a step
            total += int(2 * (s - 1) / s * 4 * sum(id(p) in f8 for p in params))
        for idx, start, end in plan:
            n = end - start
            elem = 1 if id(ordered[idx[0]]) in f8 else ps[0].element_size()  # gathered as float8
            gathers = (
                gathers_per_step(ordered[idx[0]], units, microbatches, cfg.reshard_after_forward)
                if cfg.zero == 3
                else 1
            )
            late = any(ordered[i].placement.pp_tied for i in idx)  # reduced once, in step()
            reduces = microbatches if cfg.zero >= 2 and not late else 1
            total += (s - 1) * g * n // s * reduces + gathers * ((s - 1) * elem * n // s)
        if r > 1:
            total += 2 * (r - 1) * g * (plan[-1][2] // s) // r
    # The grad norm's one fp32 scalar all-reduce (finalize.global_norm), counted like comm.all_reduce does.
    s = mesh.dp_shard.size
    return total + int(2 * (s - 1) / s * 4)


def largest_segment(
    params: list[nn.Parameter], cfg: OptimConfig, mesh: Mesh, model: nn.Module | None = None
) -> int:
    """Elements of the largest owned segment (one param's part of one rank's share of a bucket) over the shard
    ranks of this coordinate: what a resume reads into one window of the moments (and, at zero=3, of the
    master) at most (planning.memory.phases' load)."""
    best = 0
    for axis, _, ordered, plan in _plans(params, cfg, mesh, model):
        for idx, start, end in plan:
            share = (end - start) // axis.size
            at = start
            for i in idx:
                n = ordered[i].numel()
                # the param's elements [at, at + n) against the shares [start + k·share, start + (k+1)·share)
                k0, k1 = (at - start) // share, (at + n - 1 - start) // share
                for k in range(k0, k1 + 1):
                    lo, hi = max(at, start + k * share), min(at + n, start + (k + 1) * share)
                    best = max(best, hi - lo)
                at += n
    return best
