"""What the rank pool runs for the float8 parameter all-gather tests: fn(mesh, *args), module-level for
spawned workers."""

from __future__ import annotations

from tests.distributed.zero_cases import _setup, _step


def gather_probe(mesh, overrides: list[str], steps: int) -> dict | None:
    """`steps` steps; rank 0 returns the losses, every collective of step 1 (op, group, dtype, shape, bytes)
    and, under ZeRO-3 with float8 weights, their element count and the float8 buckets' sizes."""
    cfg, model, optimizer, data = _setup(mesh, overrides, steps)
    losses, step1 = [], []
    for step in range(1, steps + 1):
        mesh.stats.recent.clear()
        losses.append(_step(mesh, cfg, model, optimizer, data, step)[0])
        if step == 1:
            step1 = [{k: e[k] for k in ("op", "group", "dtype", "shape", "bytes")} for e in mesh.stats.last()]
    f8 = getattr(optimizer, "float8", None)
    if mesh.rank != 0:
        return None
    return {
        "losses": losses,
        "step1": step1,
        "float8_numel": sum(p.numel() for p in f8.params) if f8 else 0,
        "float8_params": len(f8.params) if f8 else 0,
        "float8_buckets": [
            b.numel for buf in optimizer.buffers for b in buf.buckets if getattr(b, "f8", None) is not None
        ]
        if f8
        else [],
    }
