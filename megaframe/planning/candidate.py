"""A candidate layout of the search (planning.search) and the parameter counts the memory and
step-time models (planning.steptime.timing) share: one record, read by both."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megaframe.config.choices import CPComm
from megaframe.config.schema import Config
from megaframe.parallel.rank_grid import folded_expert_groups


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    vpp: int
    dp: int
    ep: int
    zero: int
    micro_batch: int
    recompute: str
    cp: int = 1
    shard: int = 0
    """optim.shard_group_size: HSDP's shard group (0: ZeRO shards over all of cp·dp)."""
    grad_dtype: str = "fp32"
    """optim.grad_reduce_dtype: the dtype of the grad buffers and their dp reduction."""
    schedule: str = ""
    """parallel.pp_schedule ("": the config's, e.g. auto); the search also tries each kind whose spec says
    `searched` where its chunk rule admits the layout (zb_h1 at vpp=1, zbv at vpp=2)."""
    pp_layout: tuple = ()
    sp: bool = True
    """parallel.sp wherever tp > 1 (the search always; False times a layout without it, e.g. published runs
    before sequence parallelism existed)."""
    """parallel.pp_layout: layers per virtual stage (pp·vpp entries, stage = chunk·pp + rank); (): even."""

    @property
    def shard_size(self) -> int:
        """Ranks the ZeRO state is sharded over (1 at zero=0)."""
        return 0 if not self.zero else (self.shard or self.dp * self.cp)

    def expert_shard_size(self, etp: int = 1) -> int:
        """Ranks a stage's expert state is sharded over (1 at zero=0): the experts' data parallelism
        tp·cp·dp / (ep·etp), cut by HSDP's replicas, as the trainer folds the expert groups over tp·cp·dp
        (parallel/rank_grid.py); the search's layouts have etp = 1."""
        if not self.zero:
            return 1
        return folded_expert_groups(self.tp, self.cp, self.dp, self.ep, etp, self.shard).edp_shard

    def label(self) -> str:
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        hsdp = f" hsdp={self.shard}" if self.shard else ""
        grad = " grad=bf16" if self.grad_dtype == "bf16" else ""
        sched = f" {self.schedule}" if self.schedule else ""
        sched += f" layers={'/'.join(map(str, self.pp_layout))}" if self.pp_layout else ""
        return (
            f"tp={self.tp}{cp} pp={self.pp} vpp={self.vpp}{sched} "
            f"dp={self.dp}{ep} zero={self.zero}{hsdp}{grad} "
            f"mb={self.micro_batch} recompute={self.recompute}"
        )

    def overrides(self) -> list[str]:
        grad = [f"optim.grad_reduce_dtype={self.grad_dtype}"] if self.grad_dtype != "fp32" else []
        grad += [f"parallel.pp_schedule={self.schedule}"] if self.schedule else []
        grad += [f"parallel.pp_layout=[{','.join(map(str, self.pp_layout))}]"] if self.pp_layout else []
        return [
            f"parallel.tp={self.tp}",
            f"parallel.pp={self.pp}",
            f"parallel.vpp={self.vpp}",
            f"parallel.ep={self.ep}",
            f"parallel.cp={self.cp}",
            f"parallel.sp={str(self.tp > 1 and self.sp).lower()}",
            f"optim.zero={self.zero}",
            f"optim.shard_group_size={self.shard}",
            *grad,
            f"train.micro_batch_size={self.micro_batch}",
            f"train.recompute={self.recompute}",
        ]

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "label": self.label(), "overrides": self.overrides()}


def layout_config(cfg: Config, lay: Layout) -> Config:
    optim = {"zero": lay.zero, "shard_group_size": lay.shard}
    if hasattr(cfg.optim, "grad_reduce_dtype"):  # the key of optim.grad_reduce_dtype (h-gradbf16)
        optim["grad_reduce_dtype"] = lay.grad_dtype
    sched = {"pp_schedule": lay.schedule} if lay.schedule else {}
    c = dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(
            cfg.parallel,
            tp=lay.tp,
            pp=lay.pp,
            vpp=lay.vpp,
            ep=lay.ep,
            sp=lay.tp > 1 and lay.sp,
            pp_layout=list(lay.pp_layout) or None,
            cp=lay.cp,
            **sched,
        ),
        optim=dataclasses.replace(cfg.optim, **optim),
        train=dataclasses.replace(cfg.train, micro_batch_size=lay.micro_batch, recompute=lay.recompute),
    )
    return c


def cp_ring(cfg: Config) -> bool:
    """cp_comm=ring (the enum, or its string where a config was built by hand)."""
    return CPComm(cfg.parallel.cp_comm) is CPComm.ring


def layer_params(m, tp: int, ep: int) -> tuple[int, int]:
    """(dense, expert) parameters of one block on one rank: the model family's counter (models/counts.py)."""
    from megaframe.models.registry import spec_of

    return spec_of(m).layer_params(m, tp, ep)


def stage_layers(num_layers: int, lay: Layout) -> list[int]:
    """Blocks on each pipeline rank: parallel.pp_layout's virtual stages summed per rank (stage = chunk·pp +
    rank), or an even split."""
    if not lay.pp_layout:
        return [num_layers // lay.pp] * lay.pp
    return [sum(lay.pp_layout[c * lay.pp + r] for c in range(lay.vpp)) for r in range(lay.pp)]


def end_layers(m, lay: Layout, first: bool, last: bool) -> int:
    """Blocks of the first or last pipeline rank
    (the larger of the two when both; the largest when neither)."""
    per = stage_layers(m.num_layers, lay)
    return max(per[0] if first else 0, per[-1] if last else 0) if (first or last) else max(per)


def rank_layers(m, lay: Layout, rank: int) -> tuple[int, ...]:
    """Global indices of the blocks pipeline rank `rank` holds, as the trainer splits them
    (pipeline/partition.py; an even split rounded down where num_layers does not divide)."""
    from megaframe.pipeline.partition import stage_layout

    try:
        chunks = stage_layout(m.num_layers, lay.pp, lay.vpp, rank, lay.pp_layout or None).chunks
    except ValueError:  # a layout the trainer refuses still gets a plan that says so
        per = m.num_layers // (lay.pp * lay.vpp)
        chunks = [range((c * lay.pp + rank) * per, (c * lay.pp + rank + 1) * per) for c in range(lay.vpp)]
    return tuple(i for chunk in chunks for i in chunk)


def stage_params(m, lay: Layout, first: bool, last: bool) -> tuple[int, int]:
    """(dense, expert) parameters of the first or last pipeline rank (the larger of the two when both; when
    neither, the largest middle rank's blocks): the family's count of the blocks it holds and its ends."""
    from megaframe.models.registry import spec_of

    spec, pp = spec_of(m), lay.pp
    ends = [(r, r == 0, r == pp - 1) for r, end in ((0, first), (pp - 1, last)) if end]
    ranks = ends or [(r, False, False) for r in (range(1, pp - 1) or range(pp))]
    counts = (spec.rank_params(m, lay.tp, lay.ep, rank_layers(m, lay, r), f, la) for r, f, la in ranks)
    return max(counts, key=sum)
