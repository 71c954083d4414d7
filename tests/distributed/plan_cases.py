"""Functions the rank pool runs for the planner test: real per-rank memory of a small run.

Measured, per rank: mem/{params,grads,optim}_bytes as the trainer logs them (after two optimizer
steps, so lazily created optimizer state exists), the bytes one micro-batch of each chunk saves for
backward (saved_tensors_hooks on real CPU tensors, with CPU's own attention kernel), and the peak of
the activations held at once while the real pipeline executor runs a step (`LiveSaved`).
"""

from __future__ import annotations

import threading

from megaframe.config import load_config
from megaframe.optim.build import build_optimizer
from megaframe.planning.memory.activations import allocator_peak, chunk_activation_bytes
from megaframe.training.metrics import memory_figures
from tests.distributed.cases import tiny_config
from tests.forms import build_data, build_model, microbatches, train_step


class _Packed:
    """What autograd holds for one saved tensor; its end (the graph freeing it) is the storage's release."""

    def __init__(self, owner: "LiveSaved", t):
        self.owner, self.t, self.key = owner, t, t.untyped_storage()._cdata
        owner.hold(self.key, t.untyped_storage().nbytes())

    def __del__(self):
        self.owner.release(self.key)


class LiveSaved:
    """Bytes of distinct non-parameter storages saved for backward and not yet freed; tracks the peak."""

    def __init__(self, params):
        self.exclude = {p.untyped_storage()._cdata for p in params}
        self.refs: dict[int, list[int]] = {}  # storage -> [references, bytes]
        self.live = self.peak = 0
        # an overlapped kind's forward saves on a worker thread while the backward releases on this one
        self.lock = threading.Lock()

    def hold(self, key: int, nbytes: int) -> None:
        with self.lock:
            ref = self.refs.setdefault(key, [0, nbytes])
            ref[0] += 1
            if ref[0] == 1:
                self.live += nbytes
                self.peak = max(self.peak, self.live)

    def release(self, key: int) -> None:
        with self.lock:
            ref = self.refs[key]
            ref[0] -= 1
            if ref[0] == 0:
                self.live -= ref[1]
                del self.refs[key]

    def pack(self, t):
        if t.untyped_storage()._cdata in self.exclude:
            return t
        return _Packed(self, t)

    @staticmethod
    def unpack(x):
        return x.t if isinstance(x, _Packed) else x


def measure_memory(mesh, overrides: list[str]) -> dict:
    """This rank's measured figures: coordinates, logged memory, per-chunk and peak activation bytes."""
    import torch

    cfg = tiny_config(overrides + ["train.max_steps=2"], mesh.world)
    model = build_model(cfg, mesh)
    optimizer = build_optimizer(model, cfg.optim, mesh)
    data, t = build_data(cfg), cfg.train
    live = LiveSaved(model.parameters())
    for step in (1, 2):
        batches = microbatches(
            data, step - 1, t.global_batch_size, t.micro_batch_size, mesh.dp.rank, mesh.dp.size, t.seed
        )
        with torch.autograd.graph.saved_tensors_hooks(live.pack, live.unpack):
            train_step(model, optimizer, batches, mesh, cfg, step)
    chunks = [
        chunk_activation_bytes(model, c, t.micro_batch_size, fused_attention=False)
        for c in range(len(model.stage.chunks))
    ]
    return {
        "pp_rank": mesh.pp.rank,
        "tp_rank": mesh.tp.rank,
        **memory_figures(model, optimizer, mesh.device),
        "chunk_activation_bytes": chunks,
        "activation_peak_bytes": live.peak,
        "live_after": live.live,
    }


def mesh_coordinates(mesh) -> dict:
    """This rank's axes as (size, rank, member ranks), and its (pp, dp, tp) coordinate."""
    axes = {
        n: (a.size, a.rank, a.ranks, a.name)
        for n in ("tp", "dp", "pp", "pp_ends", "ep", "edp")
        for a in [getattr(mesh, n)]
    }
    return {"coord": (mesh.pp.rank, mesh.dp.rank, mesh.tp.rank), "axes": axes, "rank": mesh.rank}


def measure_cp_peak(mesh, overrides: list[str]) -> dict:
    """This cp rank's allocator peak over one forward + backward of one micro-batch (its S/cp tokens of a
    fixed global batch), after a warm-up step so the grads exist (backward accumulates into them, as every
    micro-batch after the first does) and lazy state is built; the cp causal bias (built only with attention
    dropout) is dropped first, so its first build, which the planner counts, falls inside the measurement."""
    import torch

    from megaframe.parallel.context import cp_causal_bias, cp_keep

    cfg = load_config(overrides, world_size=mesh.world, check_data=False)
    model = build_model(cfg, mesh)
    g = torch.Generator().manual_seed(0)
    ids_BS = torch.randint(
        0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.seq_length + 1), generator=g
    )
    x_BS, y_BS = (
        cp_keep(ids_BS[:, :-1], mesh.cp.rank, mesh.cp.size),
        cp_keep(ids_BS[:, 1:], mesh.cp.rank, mesh.cp.size),
    )

    def step():
        model(x_BS, y_BS).sum().backward()

    step()
    cp_causal_bias.cache_clear()
    return {"peak": allocator_peak(step), "cp_rank": mesh.cp.rank}
