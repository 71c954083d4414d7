"""The step's parts outside the micro-batches (planning.steptime.timing): the optimizer's update.

optim  after the last reduce, every rank updates the elements it owns (1/shard group under ZeRO, all of
       them at zero=0; an expert's over the experts' shard group) in one pass over HBM: it reads the grad
       (fp32, or the reduce dtype), reads and writes the update rule's state (its bytes per element:
       optim/update_rule.py's bytes_per_element at optim.state_dtype: AdamW's two moments, Muon's one),
       reads and writes the fp32 master where the params are not fp32, writes the param in its dtype, and
       reads the grads once more for the clipping norm. Nothing overlaps it (the next forward needs the
       params). Muon's Newton-Schulz iterations are GEMMs on top of this: not modelled. This is the step
       of optim.step_kernel=compiled (optim/adamw_fused.py), counted in tests/unit/optim/test_grad_bytes.py
       (34 / 26 / 30 / 22 bytes per element with bf16 params); the eager step moves more (42 / 66 / 48 /
       72: the clipped grad written back, the master cast again, bf16 state and grads widened).
"""

from __future__ import annotations

from megaframe.optim.rule_registry import rule_named
from megaframe.planning.candidate import stage_params


def update_bytes_per_element(cfg, grad_bytes: int) -> int:
    """HBM bytes the update moves per owned element (module doc)."""
    o = cfg.optim
    prec = str(getattr(cfg.train.precision, "value", cfg.train.precision))
    state = rule_named(o.name).bytes_per_element(str(getattr(o.state_dtype, "value", o.state_dtype)))
    param = 4 if prec == "fp32" else 2
    master = 0 if prec == "fp32" else 8  # the fp32 copy read and written
    return 2 * grad_bytes + 2 * state + master + param


def optimizer_seconds(s) -> float:
    """Seconds of the optimizer's update on the largest pipeline rank (module doc); s: timing._Step."""
    lay, dev = s.lay, s.dev
    if not dev.hbm_bw:  # the cpu: its measured rate folds memory traffic into the compute
        return 0.0
    dense, expert = stage_params(s.cfg.model, lay, True, lay.pp == 1)
    sh = lay.shard_size or 1
    owned = dense / sh + expert / max(sh // lay.ep, 1)
    grad = 2 if lay.grad_dtype == "bf16" else 4
    return owned * update_bytes_per_element(s.cfg, grad) / (dev.hbm_bw * dev.hbm_eff)
