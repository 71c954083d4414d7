"""What the step loop reads back from the device: the logged figures of each log step and the run's
closing line (Meter), and the count of steps skipped for a non-finite grad norm (BadSteps)."""

from __future__ import annotations

import math
import sys
import time

import torch

from megaframe.checkpoint.resume_checks import Accounting
from megaframe.config.derived import Derived
from megaframe.config.schema import ModelConfig
from megaframe.errors import TrainingError
from megaframe.model import mtp
from megaframe.model.moe import stats as moe_stats
from megaframe.parallel.mesh import Mesh
from megaframe.pipeline.executor import reduce_loss
from megaframe.training.metrics import (
    flops_per_token,
    forget_cpu_peak,
    memory_figures,
    peak_flops,
    throughput_figures,
)


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
            print(
                f"megaframe: warning: step {step} skipped: non-finite grad norm "
                f"({self.in_a_row} in a row, {self.total} in all)",
                file=sys.stderr,
                flush=True,
            )
        if self.in_a_row > self.limit:
            raise TrainingError(
                f"{self.in_a_row} steps in a row had a non-finite loss or grad norm "
                f"(train.max_bad_steps={self.limit}); stopping at step {step}"
            )


class Meter:
    """Turns the device results of the steps since the last log line into the logged figures (the
    .item() calls sync the host, at log steps only).

    `loss` is the mean LM loss over every step since the previous log line or this start (each step's loss is
    the mean over its global batch's tokens), as Megatron and torchtitan log it; `grad_norm` is the log
    step's own. `time` is unix seconds at the log line; `step_time_s` the mean wall time of those
    steps, evaluation excluded."""

    def __init__(self, m: ModelConfig, derived: Derived, mesh: Mesh, acct: Accounting):
        """`m`: the model group (FLOPs per token, layers); `derived`: the run's record (tokens per step)."""
        self.model_cfg, self.mesh, self.acct = m, mesh, acct
        self.tokens_step = derived.tokens_per_step
        self.fpt = flops_per_token(m)
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
        loss = reduce_loss(self.loss_sum, model, mesh).item() / (self.tokens_step * self.steps)
        now = time.perf_counter()
        tps = self.tokens_step * self.steps / (now - self.t_last)
        step_time = (now - self.t_last) / self.steps
        self.t_last, self.steps, self.loss_sum = now, 0, None
        speed = throughput_figures(tps, self.fpt, mesh.world, self.peak)
        if self.peak and speed["mfu"] is None and mesh.device.type == "cpu":
            forget_cpu_peak()  # a step beat the cached peak: it was measured on a busy machine
        row = {
            "step": step,
            "loss": loss,
            "lr": res.lr,
            "grad_norm": res.grad_norm.item(),
            "tokens_per_s": tps,
            "consumed_samples": self.acct.consumed(step),
            "consumed_tokens": self.acct.consumed_tokens(step),
            "time": time.time(),
            "step_time_s": step_time,
            **speed,
            **{f"comm_bytes/{g}": sent.get(g, 0) for g in ("tp", "pp", "dp", "ep", "cp")},
            **memory_figures(model, optimizer, mesh.device),
            **self.moe(step, model),
            **mtp.metrics(model, mesh),
        }
        self.last.update(row)
        return row

    def report(self, start: int, step: int, checkpoint: str | None, goodput: str = "") -> None:
        """The logger prints the summary of a run that trained at least one step (`goodput`: its part)."""
        if self.mesh.is_logger and self.run_steps:  # one write: under pp another rank prints at the same time
            sys.stdout.write(self.summary(start, step, checkpoint) + goodput + "\n")
            sys.stdout.flush()

    def summary(self, start: int, step: int, checkpoint: str | None) -> str:
        """The run's closing line: what was trained, how fast, where it ended and where it is saved."""
        wall = time.perf_counter() - self.t_start
        tokens = self.run_steps * self.tokens_step
        val = f", val_loss {self.last['val_loss']:.4f}" if "val_loss" in self.last else ""
        loss = f"final loss {self.last['loss']:.4f}{val}" if "loss" in self.last else "no step logged"
        steps = f"{self.run_steps} step{'' if self.run_steps == 1 else 's'}"
        # after a resume this start's figures are a part: the whole run's steps and tokens too (exact,
        # from the consumed count even across a batch or RoPE seq_length change)
        whole = f" | whole run: steps 1..{step}, {self.acct.consumed_tokens(step):,} tokens" if start else ""
        return (
            f"run summary: {steps} ({start + 1}..{step}), {tokens:,} tokens in {wall:.1f}s "
            f"({tokens / max(wall - self.eval_s, 1e-9):,.0f} tokens/s mean, evaluation excluded) | {loss}"
            f"{whole} | checkpoint {checkpoint or 'none'}"
        )

    def moe(self, step: int, model) -> dict:
        """aux_loss, z_loss and the per-layer expert-load figures (MoE models); warns on imbalance."""
        row = moe_stats.metrics(model, self.mesh)
        if row and self.mesh.is_logger:
            rows = moe_stats.table_rows(self.model_cfg)
            for line in moe_stats.imbalance_warnings({"step": step, **row}, rows):
                print(line, file=sys.stderr, flush=True)
        return row
