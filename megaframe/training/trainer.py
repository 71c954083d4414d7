"""The training run: start-up, the step loop, logging and checkpoints. `run(cfg)` is all train.py calls."""
from __future__ import annotations

import datetime
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megaframe.config import Config, ConfigError
from megaframe.data.dataset import Prefetcher, build_data, microbatches
from megaframe.data.order import resumed_order
from megaframe.data.shards import CorruptShard
from megaframe.inference.sampler import Sampler
from megaframe.layers.rng import seed_step
from megaframe.model.gpt import build_model
from megaframe.model.moe import stats as moe_stats
from megaframe.optim.build import build_optimizer, cast_model
from megaframe.parallel import comm
from megaframe.parallel.mesh import Mesh, build_mesh
from megaframe.pipeline import p2p
from megaframe.tracking import Tracker
from megaframe.training.checkpointing import Checkpointer
from megaframe.training.distributed import env_ranks, init_distributed, nccl_env, pick_device, shutdown
from megaframe.training.errors import TrainingError  # noqa: F401  (re-exported for train.py)
from megaframe.training.evaluate import Evaluator
from megaframe.training.faults import Injector
from megaframe.training.metrics import flops_per_token, forget_cpu_peak, memory_figures, peak_flops, throughput_figures
from megaframe.training.resume import Resumed, resume
from megaframe.training.resume_checks import Accounting
from megaframe.training.runlock import RunDirBusy, RunLock
from megaframe.training.signals import StopFlag
from megaframe.training.step import train_step
from megaframe.training.straggler import StragglerProbe
from megaframe.training.watchdog import Watchdog


def run(cfg: Config, stop: StopFlag | None = None) -> None:
    """Train under the ranks of the environment; `stop` is the caller's flag if it installed one early."""
    env = env_ranks()
    device = pick_device(cfg.train.device, env.local_rank)
    init_distributed(env, device, cfg.train.dist_timeout_s, cfg.run.dir)
    try:
        mesh = build_mesh(cfg.parallel.tp, cfg.parallel.pp, device, ep=cfg.parallel.ep, cp=cfg.parallel.cp,
                          timeout=datetime.timedelta(seconds=cfg.train.dist_timeout_s),
                          world_timeout=datetime.timedelta(seconds=cfg.checkpoint.save_timeout_s),
                          shard=cfg.optim.shard_group_size)
        # before anything else talks over pp: NCCL builds a pair's channel at its first transfer, and ranks first meeting in
        # different schedule phases can deadlock
        p2p.warm_up(mesh.pp, device)
        # ranks may have resolved a timestamped run name a second apart: rank 0's wins; the run id
        # (this launch of the run, recorded in each checkpoint's lineage) is rank 0's too
        run_id = f"{cfg.run.name}@{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}"
        cfg.run.name, cfg.run.dir, cfg.checkpoint.dir, run_id = comm.broadcast_object(
            (cfg.run.name, cfg.run.dir, cfg.checkpoint.dir, run_id), mesh)
        lock = take_run_dir(cfg, mesh)
        try:
            if device.type == "cuda" and env.world_size > 1:
                nccl_env(cfg.run.dir)  # the agreed run folder for the flight recorder's dumps
                (Path(cfg.run.dir) / "nccl_trace").mkdir(parents=True, exist_ok=True)
            train(cfg, mesh, stop or StopFlag(), run_id)
        finally:
            lock.release()
    finally:
        shutdown()


def take_run_dir(cfg: Config, mesh: Mesh) -> RunLock:
    """Rank 0 locks run.dir before anything is written there; every rank hears the outcome, so all of
    them exit 2 when another live job owns the folder."""
    lock, err = RunLock(cfg.run.dir), None
    if mesh.rank == 0:
        try:
            lock.acquire()
        except RunDirBusy as e:
            err = str(e)
        except OSError as e:
            err = f"run.dir={cfg.run.dir}: cannot take the run lock ({e})"
    # every rank reaches the broadcast whatever rank 0 found, so none goes on alone into the run folder
    err = comm.broadcast_object(err, mesh)
    if err:
        raise ConfigError(err)
    return lock


@dataclass
class Setup:
    """What start-up hands the step loop: the model and optimizer, the data, and where the run resumes."""

    model: object
    optimizer: object
    data: object
    evaluator: Evaluator | None
    sampler: Sampler | None
    resumed: Resumed
    acct: Accounting


def set_up(cfg: Config, mesh: Mesh) -> Setup:
    """Model, optimizer and data; the resume (which may adopt the saved sample order and lr horizon)."""
    model = cast_model(build_model(cfg, mesh), cfg.train.precision)
    optimizer = build_optimizer(model, cfg.optim, mesh)
    try:
        data = build_data(cfg)
        evaluator = Evaluator.build(cfg, mesh)  # None unless train.eval_interval > 0
        sampler = Sampler.build(cfg, mesh)  # None unless train.sample_interval > 0
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"data.path={cfg.data.path}: unreadable prepared data ({e})") from e
    resumed = resume(cfg, model, optimizer, mesh)
    if resumed.meta:
        data.order = resumed_order(resumed.meta)  # a resumed run keeps the sample order it began with
        adopt_lr_horizon(cfg, resumed.meta)
    if cfg.optim.lr_decay_steps is None:  # a fresh start (or a pre-horizon checkpoint): this run's length
        cfg.optim.lr_decay_steps = cfg.train.max_steps
    acct = Accounting(resumed.step, resumed.consumed if resumed.path else 0, cfg.train.global_batch_size)
    return Setup(model, optimizer, data, evaluator, sampler, resumed, acct)


def train(cfg: Config, mesh: Mesh, stop: StopFlag, run_id: str = "") -> None:
    su = set_up(cfg, mesh)
    model, optimizer, data, evaluator, sampler = su.model, su.optimizer, su.data, su.evaluator, su.sampler
    resumed, acct, start, t = su.resumed, su.acct, su.resumed.step, cfg.train
    # before the first step: a corrupt shard is bad input (exit 2 in seconds), not a crash mid-run
    check_first_shards(cfg, mesh, data, start, acct)
    total_params = global_param_count(model, mesh)  # a collective over pp: every rank takes part
    if mesh.rank == 0:
        describe(cfg, mesh, model, data, start, total_params)
        # after the resume: the config written is the one the run goes on with (lr horizon adopted)
        write_run_config(cfg, start)
    tracker = Tracker(cfg, cfg.run.dir, mesh.is_logger, cfg.train.max_steps)
    meter = Meter(cfg, mesh, acct)
    # on CUDA the grad norms are read (a host sync) only at log steps; on CPU reading is free
    bad = BadSteps(cfg.train.max_bad_steps, mesh.rank == 0, defer=mesh.device.type == "cuda")
    faults = injector(mesh.rank)
    probe = StragglerProbe(faults)
    # started after start-up: resume and shard checks may take longer than a step's hang limit
    watchdog = Watchdog(t.hang_timeout_s, mesh.rank, cfg.run.dir, mesh.stats).start()
    ckpt = Checkpointer(cfg, mesh, run_id, resumed, acct, watchdog, faults, data)
    # positions continue from the consumed samples at the resume (exact even if the batch size changed)
    loader = Prefetcher(lambda s: microbatches(data, s - 1 - start, t.global_batch_size, t.micro_batch_size,
                                               mesh.dp.rank, mesh.dp.size, t.seed, mesh.device, base=acct.base,
                                               cp_rank=mesh.cp.rank, cp_size=mesh.cp.size),
                        start + 1, t.max_steps)
    marker = {"resumed_from": str(resumed.path), "resumed_step": start, "run_id": run_id} if resumed.path else {}
    try:
        for step in range(start + 1, t.max_steps + 1):
            watchdog.beat(step)
            mesh.stats.pop()  # count only this step's bytes
            seed_step(t.seed, step, mesh)  # dropout RNG: equal on tp ranks, a function of the step (layers.rng)
            try:
                batches = loader.get(step)  # read while the previous step computed
            except CorruptShard as e:
                raise ConfigError(str(e)) from e
            res = train_step(model, optimizer, batches, mesh, cfg, step, probe)
            meter.add(res)
            try:
                bad.check(step, res.grad_norm, flush=step % t.log_interval == 0 or step == t.max_steps)
            except TrainingError as e:
                raise TrainingError(f"{e}; {ckpt.resume_hint()}") from e
            val = None
            if evaluator is not None and evaluator.due(step):
                t0 = time.perf_counter()
                val = evaluator.evaluate(model)
                meter.paused(time.perf_counter() - t0)  # tokens_per_s counts training time only
            if sampler is not None and sampler.due(step):  # sampling time is not training time either
                meter.paused(sampler.sample(step, model, cfg.run.dir, tracker.wandb_run))
            # on every rank, not only the logger: the row's dp loss all-reduce and MoE figures are collectives
            if step % t.log_interval == 0 or step == t.max_steps or val is not None:
                row = {**meter.metrics(step, res, model, optimizer), **probe.gather(mesh), **ckpt.take_io()}
                if val is not None:
                    row["val_loss"] = meter.last["val_loss"] = val
                # the first row after a resume names the checkpoint (readers see where the run restarted)
                row, marker = {**row, **marker}, {}
                tracker.log(row, start)
            stopping = False
            if checks_at(step, start, t):  # the same steps on every rank: they stop together
                stopping, writing = stop.decide(mesh, busy=ckpt.writing())
                # `writing` is the all-reduced flag, the same on every rank: all commit the background save or none does
                ckpt.poll(all_written=not writing)
            interval = cfg.checkpoint.interval
            last = step == t.max_steps or stopping
            if (interval and step % interval == 0) or last:
                bad.flush()  # a deferred grad-norm read: the save must know whether this step was skipped
                ckpt.save(model, optimizer, step, last, bad.in_a_row)
            if stopping:
                stop.report(step)
                break
        ckpt.finish()
        if mesh.is_logger and meter.run_steps:  # one write: under pp another rank prints at the same time
            sys.stdout.write(meter.summary(start, step, ckpt.last_saved) + "\n")
            sys.stdout.flush()
    finally:
        watchdog.stop()
        loader.close()
        stop.restore()
        tracker.finish()


def checks_at(step: int, start: int, t) -> bool:
    """Steps at which the ranks agree on stop signals and async-save completion (one host-side
    all-reduce over every rank): the first step, every train.signal_check_interval, log and last steps."""
    return (step == start + 1 or step % t.signal_check_interval == 0 or step % t.log_interval == 0
            or step == t.max_steps)


def injector(rank: int) -> Injector | None:
    """MEGAFRAME_INJECT's faults for this rank (read once, at start); a malformed value is bad input."""
    try:
        return Injector.from_env(rank)
    except ValueError as e:
        raise ConfigError(str(e)) from e


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
        self.flush()

    def flush(self) -> None:
        """Count every pending step now (one host sync for all of them)."""
        if not self.pending:
            return
        # the grad norm is all-reduced, so every rank counts the same skips and stops at the same step
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
    """Turns the device results of the steps since the last log line into the logged figures (the
    .item() calls sync the host, at log steps only).

    `loss` is the mean LM loss over every step since the previous log line or this start (each step's loss is the
    mean over its global batch's tokens), as Megatron and torchtitan log it; `grad_norm` is the log
    step's own. `time` is unix seconds at the log line; `step_time_s` the mean wall time of those
    steps, evaluation excluded."""

    def __init__(self, cfg: Config, mesh: Mesh, acct: Accounting):
        self.cfg, self.mesh, self.acct = cfg, mesh, acct
        self.tokens_step = cfg.train.global_batch_size * cfg.model.seq_length
        self.fpt = flops_per_token(cfg.model)
        # only the logger reports MFU; the other ranks skip the peak measurement
        self.peak = peak_flops(mesh.device) if mesh.is_logger else 0.0
        self.t_last, self.steps, self.loss_sum = time.perf_counter(), 0, None
        self.t_start, self.run_steps, self.eval_s, self.last = self.t_last, 0, 0.0, {}

    def add(self, res) -> None:
        """One step done: its loss joins the interval's sum on the device (no host sync)."""
        s = res.loss_sum.detach()
        self.loss_sum = s.clone() if self.loss_sum is None else self.loss_sum + s
        self.steps += 1
        self.run_steps += 1

    def paused(self, seconds: float) -> None:
        """Time spent outside training (evaluation): not counted in tokens_per_s or step_time_s."""
        self.t_last += seconds
        self.eval_s += seconds

    def metrics(self, step: int, res, model, optimizer) -> dict:
        mesh = self.mesh
        sent = mesh.stats.pop()
        # the log step's host sync: the interval's loss summed on the device, reduced over cp·dp and read once
        loss = comm.all_reduce(self.loss_sum, mesh.dpcp).item() / (self.tokens_step * self.steps)
        now = time.perf_counter()
        tps = self.tokens_step * self.steps / (now - self.t_last)
        step_time = (now - self.t_last) / self.steps
        self.t_last, self.steps, self.loss_sum = now, 0, None
        speed = throughput_figures(tps, self.fpt, mesh.world, self.peak)
        if self.peak and speed["mfu"] is None and mesh.device.type == "cpu":
            forget_cpu_peak()  # a step beat the cached peak: it was measured on a busy machine
        row = {"step": step, "loss": loss, "lr": res.lr, "grad_norm": res.grad_norm.item(),
               "tokens_per_s": tps, "consumed_samples": self.acct.consumed(step),
               "time": time.time(), "step_time_s": step_time, **speed,
               **{f"comm_bytes/{g}": sent.get(g, 0) for g in ("tp", "pp", "dp", "ep", "cp")},
               **memory_figures(model, optimizer, mesh.device), **self.moe(step, model)}
        self.last.update(row)
        return row

    def summary(self, start: int, step: int, checkpoint: str | None) -> str:
        """The run's closing line: what was trained, how fast, where it ended and where it is saved."""
        wall = time.perf_counter() - self.t_start
        tokens = self.run_steps * self.tokens_step
        val = f", val_loss {self.last['val_loss']:.4f}" if "val_loss" in self.last else ""
        loss = f"final loss {self.last['loss']:.4f}{val}" if "loss" in self.last else "no step logged"
        return (f"run summary: {self.run_steps} steps ({start + 1}..{step}), {tokens:,} tokens in {wall:.1f}s "
                f"({tokens / max(wall - self.eval_s, 1e-9):,.0f} tokens/s mean, evaluation excluded) | {loss} | "
                f"checkpoint {checkpoint or 'none'}")

    def moe(self, step: int, model) -> dict:
        """aux_loss, z_loss and the per-layer expert-load figures (MoE models); warns on imbalance."""
        row = moe_stats.metrics(model, self.mesh)
        if row and self.mesh.is_logger:
            for line in moe_stats.imbalance_warnings({"step": step, **row}, self.cfg.model.num_layers):
                print(line, file=sys.stderr, flush=True)
        return row


def adopt_lr_horizon(cfg: Config, meta: dict) -> None:
    """The decay horizon of the run being resumed, unless optim.lr_decay_steps is set: the one its
    checkpoint recorded, else (older checkpoints) the train.max_steps it ran with. A step-0 checkpoint
    (an import) has no curve yet, so this run's own length stands."""
    if cfg.optim.lr_decay_steps is not None or int(meta["step"]) == 0:
        return
    saved = meta.get("config", {})
    horizon = saved.get("optim", {}).get("lr_decay_steps") or saved.get("train", {}).get("max_steps")
    if horizon:
        cfg.optim.lr_decay_steps = int(horizon)


def global_param_count(model, mesh: Mesh) -> int:
    """Parameters of the whole model: this stage's global tensors summed over the pipeline stages (the
    header used to count rank 0's stage only, half the model at pp=2). A tied embedding repeated on the
    last stage (pp_duplicate) counts once."""
    mine = sum(math.prod(p.placement.shard.global_shape) for p in model.parameters()
               if not p.placement.pp_duplicate)
    if mesh.pp.size == 1:
        return mine
    # float64 holds any parameter count exactly (below 2^53); read once, at start-up
    return int(comm.all_reduce(torch.tensor([mine], dtype=torch.float64, device=mesh.device), mesh.pp).item())


def write_run_config(cfg: Config, start: int) -> None:
    """${run.dir}/config.yaml is the run's first config and is kept; a resume (which may change settings)
    writes config.resume-<step>.yaml beside it."""
    from omegaconf import OmegaConf

    from megaframe.atomic import write_atomic

    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    first = run_dir / "config.yaml"
    # config.yaml is never overwritten: it records how the run began
    path = first if not first.exists() else run_dir / f"config.resume-{start}.yaml"
    write_atomic(path, OmegaConf.to_yaml(OmegaConf.structured(cfg)))  # a crash leaves no half config


def data_label(cfg: Config) -> str:
    """What the header calls the data: data.name only where it names this data (the demo group's
    name: demo stays on when data.path points at another corpus), else the prepared folder."""
    d = cfg.data
    if d.kind == "synthetic":
        return "synthetic"
    if d.blend:
        return f"blend of {len(d.blend)} ({', '.join(Path(b.path).name for b in d.blend)})"
    from megaframe.config import CONF_DIR

    demo = (CONF_DIR.parent / "data" / "demo" / "prepared").resolve()
    if d.name == "demo" and Path(d.path).resolve() != demo:
        return str(d.path)
    return f"{d.name} ({d.path})"


def describe(cfg: Config, mesh: Mesh, model, data, start: int, total: int) -> None:
    """Print the derived sizes once, so a user can check the layout before the first step."""
    m, t = cfg.model, cfg.train
    local = sum(p.numel() for p in model.parameters())
    accum = t.global_batch_size // (t.micro_batch_size * mesh.dp.size)
    print(f"megaframe | run {cfg.run.dir} | {mesh.describe()} sp={cfg.parallel.sp}", flush=True)
    print(f"model {m.name}: {m.num_layers} layers, D={m.hidden_size}, heads {m.num_attention_heads} "
          f"(kv {m.kv_heads}), F={m.ffn_hidden_size}, vocab {m.vocab_size}, seq {m.seq_length}"
          f"{f', {m.num_experts} experts (top-{m.moe_top_k}, F={m.expert_ffn})' if m.num_experts else ''} | "
          f"params {total / 1e6:.2f}M, {local / 1e6:.2f}M on this rank | "
          f"{flops_per_token(m) / 1e6:.1f} MFLOP/token", flush=True)
    print(f"batch {t.global_batch_size} x {m.seq_length} = {t.global_batch_size * m.seq_length} tokens/step, "
          f"micro {t.micro_batch_size}, accumulation {accum} | data {data_label(cfg)}: "
          f"{'endless' if cfg.data.kind == 'synthetic' else data.num_samples} samples | "
          f"steps {start + 1}..{t.max_steps}", flush=True)


def check_first_shards(cfg: Config, mesh: Mesh, data, start: int, acct: Accounting) -> None:
    """Rank 0 hashes the shards the first global batch reads (megaframe.data.verify: a few shard files,
    not the corpus); every rank hears the verdict, so all of them stop with exit 2 on a corrupt shard."""
    if cfg.data.kind != "prepared":
        return
    err = None
    if mesh.rank == 0:
        from megaframe.data.verify import first_batch_shards, verify

        t0, nbytes = time.perf_counter(), 0
        try:
            for folder, files in first_batch_shards(data, 0, cfg.train.global_batch_size, acct.base,
                                                    cfg.train.seed).items():
                nbytes += verify(folder, files)
            print(f"data: the first batch's shards match their sha256 ({nbytes / 1e6:.1f} MB hashed in "
                  f"{time.perf_counter() - t0:.2f}s)", flush=True)
        except ValueError as e:  # CorruptShard included
            err = f"data: {e}"
    # rank 0 hashed, every rank hears the verdict: all exit 2 together, none starts the first step alone
    err = comm.broadcast_object(err, mesh)
    if err:
        raise ConfigError(err)
