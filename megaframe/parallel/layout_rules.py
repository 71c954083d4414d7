"""The layout's rules (config/checks.py runs them, in its order): every axis at least 1, the world
size they divide, context parallelism's divisions and the combinations not built (refused, never
wrong), and what dispatch by node needs. Each names the field at fault in one line; no process group
needed."""

from __future__ import annotations

from megaframe.config.numeric_rule import _req
from megaframe.config.schema import ModelConfig, ParallelConfig, TrainConfig


def check_layout(p: ParallelConfig, m: ModelConfig, t: TrainConfig, world_size: int) -> None:
    """The parallel group against itself and the world size; ConfigError on the first problem."""
    for name in ("tp", "pp", "vpp", "ep", "etp"):
        _req(getattr(p, name) >= 1, f"parallel.{name}={getattr(p, name)} must be >= 1")
    _req(
        not p.tp_comm_overlap or (p.sp and p.tp > 1),
        f"parallel.tp_comm_overlap=true overlaps sp's collectives: it needs parallel.sp=true and tp > 1 "
        f"(got parallel.sp={p.sp}, parallel.tp={p.tp})",
    )
    _req(
        world_size % (p.tp * p.pp) == 0,
        f"parallel.tp={p.tp} x parallel.pp={p.pp} does not divide the world size {world_size}",
    )
    check_context(p, m, t, world_size)
    check_ep_dispatch(p, m, world_size)


def check_context(p: ParallelConfig, m: ModelConfig, t: TrainConfig, world_size: int) -> None:
    """Context parallelism: layouts that divide, and the combinations not built (refused, never wrong)."""
    _req(p.cp >= 1, f"parallel.cp={p.cp} must be >= 1")
    if p.cp == 1:
        return
    _req(
        world_size % (p.tp * p.pp * p.cp) == 0,
        f"parallel.tp={p.tp} x parallel.cp={p.cp} x parallel.pp={p.pp} "
        f"does not divide the world size {world_size}",
    )
    _req(
        m.seq_length % (2 * p.cp) == 0,
        f"parallel.cp={p.cp} needs model.seq_length={m.seq_length} "
        "divisible by 2·cp (each rank keeps two chunks)",
    )
    _req(
        not p.sp or (m.seq_length // p.cp) % p.tp == 0,
        f"parallel.sp with parallel.cp={p.cp} needs parallel.tp={p.tp} "
        f"to divide seq_length/cp={m.seq_length // p.cp}",
    )
    # the sampler feeds whole sequences to a model whose positions are split over cp: it crashed every rank at
    # the first sample step, after training; refused before any step until it runs under cp
    _req(
        t.sample_interval == 0,
        f"train.sample_interval={t.sample_interval} is not built with parallel.cp={p.cp}: set "
        "train.sample_interval=0 (sample after training: python -m megaframe.generate CHECKPOINT_DIR)",
    )
    # scoring reads whole sequences, as the sampler does
    _req(
        t.downstream_interval == 0,
        f"train.downstream_interval={t.downstream_interval} "
        f"is not built with parallel.cp={p.cp}: set "
        "train.downstream_interval=0 (score after training: python -m megaframe.evaluate "
        "checkpoint=DIR +tasks=...)",
    )


def check_ep_dispatch(p: ParallelConfig, m: ModelConfig, world_size: int) -> None:
    """parallel.ep_dispatch=node: dropless experts without etp, and ep groups that split evenly by node."""
    if p.ep_dispatch != "node" or p.ep == 1:
        return
    _req(
        m.moe_capacity_factor is None,
        f"parallel.ep_dispatch=node with model.moe_capacity_factor={m.moe_capacity_factor}: "
        "dispatch by node runs dropless experts only (model.moe_capacity_factor=null)",
    )
    _req(p.etp == 1, f"parallel.ep_dispatch=node with parallel.etp={p.etp}: it needs parallel.etp=1")
    dp = world_size // (p.tp * p.pp * p.cp)
    # the ep groups' own rule (ep·etp dividing tp·cp·dp) is checked and named elsewhere
    if p.ranks_per_node and dp and (p.tp * p.cp * dp) % (p.ep * p.etp) == 0:
        from megaframe.parallel.rank_grid import node_refusal

        why = node_refusal(p.tp, dp, p.ep, p.cp, p.etp, p.ranks_per_node)
        _req(why is None, f"parallel.ranks_per_node={p.ranks_per_node}: {why}")
