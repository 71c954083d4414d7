"""The search's candidates: every valid (tp, cp, pp, vpp, dp, ep, ZeRO stage 0-3, HSDP shard group, grad
reduce dtype, micro-batch, recompute, schedule) of a model on N devices, each checked by validate(). cp is
searched with the config's parallel.cp_comm. ZeRO-0 only for fp32 (bf16 params need ZeRO's fp32 master);
bf16 grad reduction only under bf16; HSDP shard groups of whole nodes (tp·cp·s a multiple of a node) smaller
than cp·dp."""

from __future__ import annotations

import dataclasses

from megaframe.config import Config, ConfigError, validate
from megaframe.parallel.rank_grid import node_refusal
from megaframe.planning.candidate import Layout, layout_config

RECOMPUTE = ("none", "selective", "full", "op_selective")


MICRO_BATCHES = (1, 2, 4, 8)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _state_choices(
    cfg: Config, tp: int, cp: int, dp: int, ep: int, per_node: int
) -> list[tuple[int, int, str]]:
    """(zero, HSDP shard group, grad reduce dtype) of one (tp, cp, dp, ep)."""
    bf16 = cfg.train.precision in ("bf16", "fp8")  # fp8 keeps bf16 params with ZeRO's fp32 master
    grads = ("fp32", "bf16") if bf16 else ("fp32",)
    dpcp, out = dp * cp, []
    # HSDP: shard groups of whole nodes
    # (the shard's all-gathers on NVLink or spread evenly over nodes), below cp·dp
    shards = (
        [s for s in divisors(dpcp) if 1 < s < dpcp and (tp * cp * s) % max(per_node, 1) == 0]
        if ep == 1
        else []
    )
    zeros = (1, 2, 3) if dpcp > 1 else (1,)  # nothing to shard over one rank: ZeRO-2/3 build ZeRO-1's layout
    for zero in zeros if bf16 else (0, *zeros):
        for shard in [0] + shards if zero else [0]:
            out += [(zero, shard, g) for g in (grads if zero else ("fp32",))]
    return out


def candidates(cfg: Config, world: int, per_node: int, keep=None, progress=None) -> list[Layout]:
    """Every layout validate() accepts: tp within a node, pp dividing the layers (or, past two stages, the
    first and last stage one block short: Llama 3's 126 layers on pp16), vpp up to 8, sp wherever tp > 1.
    `keep(layout)`: only the layouts it accepts are validated (a narrower search). `progress(text)` hears
    the validation's count every few seconds (minutes for llama3_8b on 64 ranks on a busy machine)."""
    lays = [x for x in _layouts(cfg, world, per_node) if keep is None or keep(x)]
    return _valid(cfg, world, lays, Ticker(progress, "validated", len(lays)))


class Ticker:
    """`progress(f"search: {i}/{total} layouts {what} ...")` at most every EVERY_S seconds: a long search
    says how far it got within seconds instead of looking hung."""

    EVERY_S = 3.0

    def __init__(self, progress, what: str, total: int):
        import time

        self.say, self.what, self.total = progress, what, total
        self.t0 = self.last = time.perf_counter()

    def tick(self, i: int, note: str = "") -> None:
        import time

        now = time.perf_counter()
        if self.say is not None and now - self.last >= self.EVERY_S:
            self.last = now
            self.say(f"search: {i}/{self.total} layouts {self.what}{note} ({now - self.t0:.0f}s)")


def _layouts(cfg: Config, world: int, per_node: int):
    """The layouts candidates() validates, in its order (cheap: no config is built)."""
    m = cfg.model
    # tp within a node: its per-block all-reduces need the intra-node links
    for tp, cp in [(t, c) for t in divisors(world) if t <= max(per_node, 1) for c in divisors(world // t)]:
        for pp, split in _pipelines(m.num_layers, world // (tp * cp)):
            dp = world // (tp * cp * pp)
            micro = {cfg.train.global_batch_size // (b * dp) for b in MICRO_BATCHES} - {0}
            for vpp in [1] if pp == 1 or split else [v for v in VPP if m.num_layers % (pp * v) == 0]:
                # ep folds over the stage's tp·cp·dp ranks, tp first, as the trainer places the experts
                # (parallel/rank_grid.py): Megatron-Bridge's Qwen3-235B ep32 over tp2 x dp16
                for ep, sched in [
                    (e, s)
                    for e in _expert_sizes(cfg, tp, cp, dp, per_node)
                    for s in _schedules(pp, vpp, micro, m.num_experts > 0)
                ]:
                    yield from (
                        Layout(tp, pp, vpp, dp, ep, zero, mb, rc, cp, shard, g, sched, split)
                        for zero, shard, g in _state_choices(cfg, tp, cp, dp, ep, per_node)
                        for mb in MICRO_BATCHES
                        for rc in RECOMPUTE
                    )


def _expert_sizes(cfg: Config, tp: int, cp: int, dp: int, per_node: int) -> list[int]:
    """The ep sizes tried for a stage of tp·cp·dp ranks: those dividing it and the experts, and under
    parallel.ep_dispatch=node only the ones the nodes cut evenly (the trainer refuses the rest)."""
    m, p = cfg.model, cfg.parallel
    if not m.num_experts:
        return [1]
    sizes = [e for e in divisors(tp * cp * dp) if m.num_experts % e == 0]
    if p.ep_dispatch != "node":
        return sizes
    return [e for e in sizes if e == 1 or node_refusal(tp, dp, e, cp, p.etp, per_node) is None]


VPP = (1, 2, 4, 8)
"""Virtual stages per pipeline rank the search tries."""


def _pipelines(layers: int, ranks: int) -> list[tuple[int, tuple]]:
    """(pp, pp_layout) for each pp dividing `ranks`: an even split where pp divides the layers, and past
    two stages the first and last one block short (they also hold the embedding and the head)."""
    out = []
    for pp in divisors(ranks):
        if layers % pp == 0:
            out.append((pp, ()))
        if pp > 2 and (layers + 2) % pp == 0 and (layers + 2) // pp > 1:
            n = (layers + 2) // pp
            out.append((pp, (n - 1, *[n] * (pp - 2), n - 1)))
    return out


def _schedules(pp: int, vpp: int, micro: set[int], moe: bool = False) -> list[str]:
    """The config's schedule (""), past one stage each spec marked `searched` (zb_h1, zbv), and for a model
    with experts the overlapped kinds (their pairs hide the all-to-alls), each where its chunk rule admits
    (pp, vpp) at one of the micro-batch counts `micro` (validate() checks each layout's)."""
    from megaframe.pipeline.schedule import SCHEDULES

    tried = [s.name for s in SCHEDULES.values() if (s.searched and pp > 1) or (s.overlap and moe)]
    return [""] + [k for k in tried if any(SCHEDULES[k].chunk_rule(pp, vpp, m) is None for m in micro)]


def _valid(cfg: Config, world: int, lays: list[Layout], ticker: Ticker | None = None) -> list[Layout]:
    """The layouts validate() accepts. The grad dtype and HSDP group change nothing validate() reads but
    their own checks: one layout per (zero, shard, rest) is validated and its verdict shared."""
    out, seen = [], {}
    for i, lay in enumerate(lays):
        if ticker is not None:
            ticker.tick(i, f", {len(out)} valid")
        key = dataclasses.replace(lay, grad_dtype="fp32")
        if key not in seen:
            try:
                # schedules=False: building every candidate's schedules doubled the search; the layout a
                # user then runs is validated in full (schedules built) by train.py
                validate(layout_config(cfg, key), world, check_data=False, schedules=False)
                seen[key] = True
            except ConfigError:
                seen[key] = False
        if seen[key]:
            out.append(lay)
    return out
