"""Counting the memory traffic of torch ops on chosen tensors (a TorchDispatchMode), for tests that hold the
bytes per parameter of the optimizer step and of each micro-batch's gradient accumulation to a table.

An op reads every tensor argument it takes and writes the ones its schema marks as written; `out=` tensors and
the self of zero_/fill_/copy_ are written only; fresh results are written. View ops and empty allocations move
no data and are skipped. Only tensors `tracked(t)` selects count (e.g. those on the optimizer's storages).
Fused AdamW writes its grads back only when it is given a grad_scale (torch's CPU and CUDA kernels both).
megaframe's own ops (layers/wgrad.py's) are opaque to the mode: their Python bodies' ops are counted instead.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from megaframe.layers import wgrad

aten = torch.ops.aten
BODIES = {"megaframe::wgrad_into_main": wgrad.wgrad_body}
WRITE_ONLY_SELF = {"zero_", "fill_", "copy_", "_foreach_copy_"}
NO_DATA = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "new_full",
    "new_zeros",
    "new_ones",
    "resize_",
    "set_",
}
# self: only the indexed elements (index_put_'s third argument is its values: one per element touched)
INDEXED = {"gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "index_put", "index_put_"}


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensors(v) -> list[torch.Tensor]:
    return [t for t in tree_flatten(v)[0] if isinstance(t, torch.Tensor)]


class ByteCount(TorchDispatchMode):
    """bytes[(phase, 'read'|'write')] of the tracked tensors; `phase` is set by the caller between ops."""

    def __init__(self, tracked):
        super().__init__()
        self.tracked, self.phase, self.bytes = tracked, "", Counter()
        self.ops = Counter()  # (phase, op name) -> bytes: what to look at when a count moves

    def _add(self, kind: str, ts, name: str, numel: int | None = None) -> None:
        for t in ts:
            # a wrapper subclass (torchao's float8 tensor) has no storage: its ops reach the mode again on
            # its inner plain tensors, counted there
            if is_traceable_wrapper_subclass(t):
                continue
            if t.numel() and self.tracked(t):
                n = (t.numel() if numel is None else numel) * t.element_size()
                self.bytes[(self.phase, kind)] += n
                self.ops[(self.phase, name)] += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        body = BODIES.get(func._schema.name)
        if body is not None:  # a megaframe op: count the ops its Python body runs
            with self:
                return body(*args, **kwargs)
        out = func(*args, **kwargs)
        schema, name = func._schema, func.__name__.split(".")[0]
        if name in NO_DATA or (
            schema.returns
            and schema.returns[0].alias_info is not None
            and not schema.returns[0].alias_info.is_write
        ):
            return out  # a view or an allocation: no data moves
        written = set()
        for i, a in enumerate(schema.arguments):
            v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
            ts = _tensors(v)
            if not ts:
                continue
            write = a.alias_info is not None and a.alias_info.is_write
            read = not write or not (a.name == "out" or (a.name == "self" and name in WRITE_ONLY_SELF))
            if name.startswith("_fused_adam") and a.name == "grads":  # written back only to unscale them
                write = kwargs.get("grad_scale") is not None
                read = True
            numel = kwargs.get("index", args[2] if len(args) > 2 else None)
            numel = numel.numel() if name in INDEXED and a.name == "self" else None
            if read:
                self._add("read", ts, name, numel)
            if write:
                self._add("write", ts, name, numel)
                written.update(id(t) for t in ts)
        if not any(r.alias_info is not None for r in schema.returns):
            self._add("write", [t for t in _tensors(out) if id(t) not in written], name)
        return out

    def per(self, phase: str, n: int) -> float:
        return (self.bytes[(phase, "read")] + self.bytes[(phase, "write")]) / n
