"""The training run: start-up, the step loop, logging and checkpoints. `run(cfg)` is all train.py calls."""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path

import torch

from megaframe.checkpoint import sharded
from megaframe.checkpoint.async_save import AsyncSaver
from megaframe.config import Config, ConfigError
from megaframe.data.dataset import Prefetcher, build_data, data_state, microbatches
from megaframe.layers.shard import param_seed
from megaframe.model.gpt import build_model
from megaframe.model.moe import stats as moe_stats
from megaframe.optim.build import build_optimizer, cast_model
from megaframe.parallel import comm
from megaframe.parallel.mesh import Mesh, build_mesh
from megaframe.pipeline import p2p
from megaframe.tracking import Tracker
from megaframe.training.distributed import env_ranks, init_distributed, pick_device, shutdown
from megaframe.training.evaluate import Evaluator
from megaframe.training.faults import Injector
from megaframe.training.metrics import flops_per_token, memory_figures, peak_flops, throughput_figures
from megaframe.training.signals import StopFlag
from megaframe.training.step import train_step
from megaframe.training.straggler import StragglerProbe
from megaframe.training.watchdog import Watchdog


def run(cfg: Config, stop: StopFlag | None = None) -> None:
    """Train under the ranks of the environment; `stop` is the caller's flag if it installed one early."""
    env = env_ranks()
    device = pick_device(cfg.train.device, env.local_rank)
    init_distributed(env, device)
    try:
        mesh = build_mesh(cfg.parallel.tp, cfg.parallel.pp, device, ep=cfg.parallel.ep,
                          shard=cfg.optim.shard_group_size)
        p2p.warm_up(mesh.pp, device)
        # ranks may have resolved a timestamped run name a second apart: rank 0's wins
        cfg.run.name, cfg.run.dir, cfg.checkpoint.dir = comm.broadcast_object(
            (cfg.run.name, cfg.run.dir, cfg.checkpoint.dir))
        train(cfg, mesh, stop or StopFlag())
    finally:
        shutdown()


def train(cfg: Config, mesh: Mesh, stop: StopFlag) -> None:
    model = cast_model(build_model(cfg, mesh), cfg.train.precision)
    optimizer = build_optimizer(model, cfg.optim, mesh)
    try:
        data = build_data(cfg)
        evaluator = Evaluator.build(cfg, mesh)  # None unless train.eval_interval > 0
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"data.path={cfg.data.path}: unreadable prepared data ({e})") from e
    start = resume(cfg, model, optimizer, mesh)
    if mesh.rank == 0:
        describe(cfg, mesh, model, data, start)
        Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
        from omegaconf import OmegaConf
        (Path(cfg.run.dir) / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    tracker = Tracker(cfg, cfg.run.dir, mesh.is_logger, cfg.train.max_steps)
    meter = Meter(cfg, mesh)
    saver = AsyncSaver(mesh) if cfg.checkpoint.async_save else None
    # on CUDA the grad norms are read (a host sync) only at log steps; on CPU reading is free
    bad = BadSteps(cfg.train.max_bad_steps, mesh.rank == 0, defer=mesh.device.type == "cuda")
    t = cfg.train
    probe = StragglerProbe(injector(mesh.rank))
    watchdog = Watchdog(t.hang_timeout_s, mesh.rank, cfg.run.dir, mesh.stats).start()
    loader = Prefetcher(lambda s: microbatches(data, s - 1, t.global_batch_size, t.micro_batch_size, mesh.dp.rank,
                                               mesh.dp.size, t.seed, mesh.device), start + 1, t.max_steps)
    try:
        for step in range(start + 1, t.max_steps + 1):
            watchdog.beat(step)
            mesh.stats.pop()  # count only this step's bytes
            # dropout RNG is a function of (seed, step, rank): resume needs no RNG state
            torch.manual_seed(param_seed(t.seed, f"dropout/step{step}/rank{mesh.rank}"))
            batches = loader.get(step)  # read while the previous step computed
            res = train_step(model, optimizer, batches, mesh, cfg, step, probe)
            meter.steps += 1
            bad.check(step, res.grad_norm, flush=step % t.log_interval == 0 or step == t.max_steps)
            val = None
            if evaluator is not None and evaluator.due(step):
                t0 = time.perf_counter()
                val = evaluator.evaluate(model)
                meter.t_last += time.perf_counter() - t0  # tokens_per_s counts training time only
            if step % t.log_interval == 0 or step == t.max_steps or val is not None:
                row = {**meter.metrics(step, res, model, optimizer), **probe.gather(mesh)}
                tracker.log(row if val is None else {**row, "val_loss": val}, start)
            stopping = stop.agreed(mesh)
            if saver:
                saver.poll()
            interval = cfg.checkpoint.interval
            last = step == t.max_steps or stopping
            if (interval and step % interval == 0) or last:
                if saver and last:
                    saver.wait()  # commit the older one first, so `latest` ends on this step
                save(cfg, model, optimizer, mesh, step, saver if not last else None)
                watchdog.beat()
            if stopping:
                stop.report(step)
                break
        if saver:
            saver.wait()
    finally:
        watchdog.stop()
        loader.close()
        stop.restore()
        tracker.finish()


def injector(rank: int) -> Injector | None:
    """MEGAFRAME_INJECT's faults for this rank (read once, at start); a malformed value is bad input."""
    try:
        return Injector.from_env(rank)
    except ValueError as e:
        raise ConfigError(str(e)) from e


class TrainingError(RuntimeError):
    """The run cannot go on (not a bad input): train.py prints it on one line and exits 1."""


class BadSteps:
    """Counts optimizer steps skipped for a non-finite grad norm; too many in a row end the run.

    The optimizer skips such steps on the device; with `defer` the norms are only read (one host sync
    for all of them) at flush steps, so a warning or the stop comes at the next log step."""

    def __init__(self, limit: int, verbose: bool, defer: bool = False):
        self.limit, self.verbose, self.defer, self.in_a_row, self.total = limit, verbose, defer, 0, 0
        self.pending: list[tuple[int, torch.Tensor]] = []

    def check(self, step: int, grad_norm: torch.Tensor, flush: bool = True) -> None:
        self.pending.append((step, grad_norm))
        if self.defer and not flush:
            return
        norms = torch.stack([n for _, n in self.pending]).tolist()  # syncs the device, once for all pending
        steps, self.pending = [s for s, _ in self.pending], []
        for s, norm in zip(steps, norms):
            self._count(s, norm)

    def _count(self, step: int, norm: float) -> None:
        if math.isfinite(norm):
            self.in_a_row = 0
            return
        self.in_a_row, self.total = self.in_a_row + 1, self.total + 1
        if self.verbose:
            print(f"megaframe: warning: step {step} skipped: non-finite grad norm "
                  f"({self.in_a_row} in a row, {self.total} in all)", file=sys.stderr, flush=True)
        if self.in_a_row > self.limit:
            raise TrainingError(f"{self.in_a_row} steps in a row had a non-finite loss or grad norm "
                                f"(train.max_bad_steps={self.limit}); stopping at step {step}")


class Meter:
    """Turns a step's device results into the logged figures (the .item() calls sync the host)."""

    def __init__(self, cfg: Config, mesh: Mesh):
        self.cfg, self.mesh = cfg, mesh
        self.tokens_step = cfg.train.global_batch_size * cfg.model.seq_length
        self.fpt = flops_per_token(cfg.model)
        self.peak = peak_flops(mesh.device) if mesh.is_logger else 0.0
        self.t_last, self.steps = time.perf_counter(), 0

    def metrics(self, step: int, res, model, optimizer) -> dict:
        mesh = self.mesh
        sent = mesh.stats.pop()
        loss = comm.all_reduce(res.loss_sum.clone(), mesh.dp).item() / self.tokens_step
        now = time.perf_counter()
        tps = self.tokens_step * self.steps / (now - self.t_last)
        self.t_last, self.steps = now, 0
        return {"step": step, "loss": loss, "lr": res.lr, "grad_norm": res.grad_norm.item(),
                "tokens_per_s": tps, "consumed_samples": step * self.cfg.train.global_batch_size,
                **throughput_figures(tps, self.fpt, mesh.world, self.peak),
                **{f"comm_bytes/{g}": sent.get(g, 0) for g in ("tp", "pp", "dp", "ep")},
                **memory_figures(model, optimizer, mesh.device), **self.moe(step, model)}

    def moe(self, step: int, model) -> dict:
        """aux_loss, z_loss and the per-layer expert-load figures (MoE models); warns on imbalance."""
        row = moe_stats.metrics(model, self.mesh)
        if row and self.mesh.is_logger:
            for line in moe_stats.imbalance_warnings({"step": step, **row}, self.cfg.model.num_layers):
                print(line, file=sys.stderr, flush=True)
        return row


def save(cfg: Config, model, optimizer, mesh: Mesh, step: int, saver: AsyncSaver | None = None) -> None:
    """Checkpoint at `step`: in the background with `saver`, else written and committed now."""
    t0 = time.perf_counter()
    optimizer.sync_params()  # ZeRO's overlapped all-gather may still be writing the params
    meta = {"consumed_samples": step * cfg.train.global_batch_size,
            "layout": {"tp": mesh.tp.size, "pp": mesh.pp.size, "dp": mesh.dp.size, "ep": mesh.ep.size,
                       "sp": cfg.parallel.sp},
            "rng": "derived from (train.seed, step, rank); no state to restore",
            "data": data_state(cfg, step),
            "config": dataclasses.asdict(cfg)}
    if saver is not None:
        saver.save(cfg.checkpoint.dir, step, model, optimizer, meta, cfg.checkpoint.keep_last)
        if mesh.rank == 0:
            print(f"checkpoint: step {step} copied to host in {time.perf_counter() - t0:.2f}s, writing", flush=True)
        return
    path = sharded.save(cfg.checkpoint.dir, step, model, optimizer, mesh, meta, cfg.checkpoint.keep_last)
    if mesh.rank == 0:
        print(f"checkpoint: {path} ({time.perf_counter() - t0:.2f}s)", flush=True)


def resume(cfg: Config, model, optimizer, mesh: Mesh) -> int:
    """Load the checkpoint named by checkpoint.resume; returns the step it holds (0 when starting fresh)."""
    if cfg.checkpoint.resume == "none":
        return 0
    def skipped(path, reason):
        if mesh.rank == 0:
            print(f"megaframe: warning: skipping checkpoint {path}: {reason}", file=sys.stderr, flush=True)

    if cfg.checkpoint.resume == "auto":
        path = sharded.latest(cfg.checkpoint.dir, on_skip=skipped)
    else:
        path = Path(cfg.checkpoint.resume)
    if path is None:
        return 0
    try:
        meta = sharded.load_into(path, model, optimizer)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ConfigError(f"checkpoint {path} cannot be loaded ({str(e).splitlines()[0]})") from e
    if mesh.rank == 0:
        print(f"resumed from {path} at step {meta['step']}", flush=True)
    return int(meta["step"])


def describe(cfg: Config, mesh: Mesh, model, data, start: int) -> None:
    """Print the derived sizes once, so a user can check the layout before the first step."""
    m, t = cfg.model, cfg.train
    local = sum(p.numel() for p in model.parameters())
    total = sum(math.prod(p.placement.shard.global_shape) for p in model.parameters())
    accum = t.global_batch_size // (t.micro_batch_size * mesh.dp.size)
    print(f"megaframe | run {cfg.run.dir} | {mesh.describe()} sp={cfg.parallel.sp}", flush=True)
    print(f"model {m.name}: {m.num_layers} layers, D={m.hidden_size}, heads {m.num_attention_heads} "
          f"(kv {m.kv_heads}), F={m.ffn_hidden_size}, vocab {m.vocab_size}, seq {m.seq_length}"
          f"{f', {m.num_experts} experts (top-{m.moe_top_k}, F={m.expert_ffn})' if m.num_experts else ''} | "
          f"params {total / 1e6:.2f}M, {local / 1e6:.2f}M on this rank | "
          f"{flops_per_token(m) / 1e6:.1f} MFLOP/token", flush=True)
    print(f"batch {t.global_batch_size} x {m.seq_length} = {t.global_batch_size * m.seq_length} tokens/step, "
          f"micro {t.micro_batch_size}, accumulation {accum} | data {cfg.data.name}: "
          f"{'endless' if cfg.data.kind == 'synthetic' else data.num_samples} samples | "
          f"steps {start + 1}..{t.max_steps}", flush=True)
