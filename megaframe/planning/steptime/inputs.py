"""What every part of one layout's step time reads (planning.steptime.timing and its parts): the config, the
layout, the device and the world, with the sizes they derive, and the link model a collective is timed on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from megaframe.config.schema import Config
from megaframe.planning.candidate import Layout, stage_layers
from megaframe.planning.devices import Device
from megaframe.planning.gloo_link import hop_seconds
from megaframe.planning.steptime.compute import step_compute


def ring_seconds(nbytes: float, n: int, steps: float, bw: float, latency: float, hops: tuple = ()) -> float:
    """Seconds for a collective moving nbytes per rank over a ring of n ranks in `steps` hops: bandwidth
    plus a latency per hop, or `steps` hops of nbytes / steps on a measured curve (Device.hops)."""
    if n <= 1:
        return 0.0
    return steps * hop_seconds(hops, nbytes / steps) if hops else nbytes / bw + steps * latency


@dataclass(frozen=True)
class Step:
    """What every part of one layout's step time reads."""

    cfg: Config
    lay: Layout
    dev: Device
    world: int

    @property
    def elem(self) -> int:
        return 4 if self.cfg.train.precision == "fp32" else 2  # fp8 runs keep bf16 activations

    @property
    def micro(self) -> int:
        """Micro-batches per step on a rank."""
        return self.cfg.train.global_batch_size // (self.lay.micro_batch * self.lay.dp)

    @property
    def layers(self) -> int:
        """Blocks of the largest pipeline stage (an uneven parallel.pp_layout: its largest rank)."""
        return max(stage_layers(self.cfg.model.num_layers, self.lay))

    @functools.cached_property
    def work(self) -> dict[str, float]:
        """Compute seconds of the slowest pipeline rank by kind (steptime.compute): its blocks, the head
        on the last rank."""
        lays = stage_layers(self.cfg.model.num_layers, self.lay)
        parts = [
            step_compute(self.cfg, self.dev, self.lay, n, self.micro, r == len(lays) - 1)
            for r, n in enumerate(lays)
        ]
        return max(parts, key=lambda p: sum(p.values()))

    @property
    def act(self) -> int:
        """Bytes of one micro-batch's [S/cp, B, D] activations: a cp rank's S/cp tokens."""
        m = self.cfg.model
        return self.lay.micro_batch * m.seq_length // self.lay.cp * m.hidden_size * self.elem

    @property
    def share(self) -> float:
        """Ranks beyond the cores share them (cpu): each rank gets cores/world of one."""
        return min(1.0, self.dev.per_node / self.world) if self.dev.name.startswith("cpu") else 1.0

    def coll(self, nbytes: float, n: int, steps: float, span: int) -> float:
        """A ring collective over n ranks whose group spans
        `span` consecutive ranks (NVLink within a node)."""
        d = self.dev
        on_node = d.name.startswith("cpu") or span <= d.per_node
        bw = (d.intra_bw if on_node else d.inter_bw) * d.link_eff
        return ring_seconds(nbytes, n, steps, bw, d.latency_s if on_node else d.inter_latency_s, d.hops)
