"""The step's parts outside the micro-batches (planning.steptime.timing): the optimizer's update.

optim  after the last reduce, every rank updates the elements it owns (1/shard group under ZeRO, all of
       them at zero=0; an expert's over the experts' shard group) in one pass over HBM: it reads the grad
       (fp32, or the reduce dtype), reads and writes the update rule's state (its bytes per element:
       optim/update_rule.py's bytes_per_element at optim.state_dtype: AdamW's two moments, Muon's one),
       reads and writes the fp32 master where the params are not fp32, writes the param in its dtype, and
       reads the grads once more for the clipping norm. Nothing overlaps it (the next forward needs the
       params). Muon's Newton-Schulz iterations are GEMMs on top of this: not modelled. That is the step of
       optim.step_kernel=compiled (optim/adamw_fused.py). The eager step (the default) moves more: torch's
       fused AdamW writes the clipped grad back (4) and the master is read again for its cast to the
       params (4); bf16 grads are first widened to fp32 (read 2, write 4) and bf16 state is widened and
       rounded back around the update (2 x (its bf16 + fp32 bytes)). Both held to the bytes counted op by
       op in tests/unit/optim/test_grad_bytes.py (bf16 params: compiled 34 / 26 / 30 / 22, eager 42 / 66 /
       48 / 72 for fp32 or bf16 state x fp32 or bf16 grads).
"""

from __future__ import annotations

from megaframe.optim.rule_registry import rule_named
from megaframe.planning.candidate import stage_params


def update_bytes_per_element(cfg, grad_bytes: int) -> int:
    """HBM bytes the update moves per owned element (module doc)."""
    o = cfg.optim
    # StrEnum members: str() gives the value (a config read back from a dict holds the plain strings)
    prec, dtype = str(cfg.train.precision), str(o.state_dtype)
    rule = rule_named(o.name)
    state = rule.bytes_per_element(dtype)
    param = 4 if prec == "fp32" else 2
    master = 0 if prec == "fp32" else 8  # the fp32 copy read and written
    if str(o.step_kernel) == "compiled":
        return 2 * grad_bytes + 2 * state + master + param
    # eager: the norm and torch's fused AdamW read fp32 grads and step fp32 state (widened first)
    fp32_state = rule.bytes_per_element("fp32")
    grad_back = 4 + (4 if master else 0)  # the clipped grad written back; the master read for its cast
    widen_grads = 6 if grad_bytes == 2 else 0
    widen_state = 2 * (state + fp32_state) if dtype == "bf16" else 0
    return 2 * 4 + 2 * fp32_state + master + param + grad_back + widen_grads + widen_state


def optimizer_seconds(s) -> float:
    """Seconds of the optimizer's update on the largest pipeline rank (module doc); s: inputs.Step."""
    lay, dev = s.lay, s.dev
    if not dev.hbm_bw:  # the cpu: its measured rate folds memory traffic into the compute
        return 0.0
    dense, expert = stage_params(s.cfg.model, lay, True, lay.pp == 1)
    sh = lay.shard_size or 1
    owned = dense / sh + expert / lay.expert_shard_size(s.cfg.parallel.etp)
    grad = 2 if lay.grad_dtype == "bf16" else 4
    return owned * update_bytes_per_element(s.cfg, grad) / (dev.hbm_bw * dev.hbm_eff)
