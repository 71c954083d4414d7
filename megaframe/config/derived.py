"""Values worked out from the frozen config, once per run, into one frozen record (`Derived`) that the
components receive beside their own config group: the data-parallel size, the micro-batches and tokens of
one optimizer step, the pipeline schedule `parallel.pp_schedule=auto` resolves to and whether its chunks
sit in a V, the LR decay horizon, and the run id. Nothing is written back into the config.

A config that must carry a settled value on to what it records (the run names rank 0 chose, the LR
horizon a resume adopts: both are written into config.yaml and checkpoint metadata, and a later resume
reads them there) is a new config made by `settled`, frozen like the loaded one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megaframe.config.frozen import freeze, is_frozen
from megaframe.config.schema import Config, OptimConfig, ParallelConfig, TrainConfig


@dataclass(frozen=True)
class Derived:
    dp: int
    """Data-parallel ranks: world size / (tp x pp x cp)."""
    micro_batches: int
    """Micro-batches each dp rank runs per optimizer step: global batch / (micro batch x dp)."""
    tokens_per_step: int
    """Tokens of one optimizer step over every rank: global batch x sequence length (the loss divisor)."""
    pp_schedule: str
    """The pipeline schedule run: parallel.pp_schedule with `auto` resolved."""
    v_placement: bool
    """Chunks placed in a V (zbv: rank r holds stages r and 2·pp-1-r) rather than a loop."""
    lr_horizon: int
    """Steps the LR decays over: optim.lr_decay_steps, else a resumed run's, else train.max_steps."""
    run_id: str = ""
    """This launch of the run (rank 0's, recorded in each checkpoint's lineage); empty outside training."""


def schedule_kind(p: ParallelConfig) -> str:
    """The schedule parallel.pp_schedule names, `auto` resolved (interleaved when vpp > 1, else 1f1b)."""
    from megaframe.pipeline.schedule import resolve_kind

    return resolve_kind(str(p.pp_schedule), p.vpp)


def lr_horizon(o: OptimConfig, t: TrainConfig, meta: dict | None = None) -> int:
    """optim.lr_decay_steps when set; else the horizon of the run being resumed (`meta`: its checkpoint's
    metadata; older checkpoints record only the train.max_steps it ran with); else this run's length. A
    step-0 checkpoint (an import) has no curve yet, so this run's own length stands."""
    if o.lr_decay_steps is not None:
        return int(o.lr_decay_steps)
    if meta and int(meta.get("step", 0)) != 0:
        saved = meta.get("config", {})
        horizon = saved.get("optim", {}).get("lr_decay_steps") or saved.get("train", {}).get("max_steps")
        if horizon:
            return int(horizon)
    return int(t.max_steps)


def derive(cfg: Config, world_size: int, meta: dict | None = None, run_id: str = "") -> Derived:
    """The record for `cfg` run on `world_size` ranks; `meta`: the resumed checkpoint's metadata, if any."""
    from megaframe.pipeline.schedule import is_v

    p, t = cfg.parallel, cfg.train
    # at least one: a step run by hand on fewer processes than the layout names (a test's single process)
    dp = max(1, world_size // (p.tp * p.pp * p.cp))
    kind = schedule_kind(p)
    return Derived(
        dp=dp,
        micro_batches=t.global_batch_size // (t.micro_batch_size * dp),
        tokens_per_step=t.global_batch_size * cfg.model.seq_length,
        pp_schedule=kind,
        v_placement=is_v(kind),
        lr_horizon=lr_horizon(cfg.optim, t, meta),
        run_id=run_id,
    )


def settled(cfg: Config, **groups: dict) -> Config:
    """A new config with the fields `groups` names replaced (settled(cfg, run={"dir": d})), frozen when
    `cfg` is. The one way a value worked out after loading reaches what the run records."""
    changes = {g: dataclasses.replace(getattr(cfg, g), **fields) for g, fields in groups.items()}
    new = dataclasses.replace(cfg, **changes)
    return freeze(new) if is_frozen(cfg) else new
