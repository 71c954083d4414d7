"""Host syncs per training step, counted on CPU: what would make the host wait for the GPU on CUDA.

CPU tensors never stall the host, so the counter intercepts the operations that do on CUDA:
- reading a device value: `Tensor.item`, `bool()`, `float()`, `int()` of a tensor (all reach
  aten._local_scalar_dense, also when torch calls them internally), `Tensor.tolist`, `Tensor.numpy`;
- Python data placed on the device: `torch.tensor` / `torch.as_tensor` with an explicit `device=`
  (a pageable host-to-device copy, which CUDA makes synchronous);
- ops whose output size depends on the data (the host must read it): nonzero, bincount, unique,
  masked_select, boolean-mask indexing, repeat_interleave without `output_size`.
Separately it counts collectives outside the mesh's axis groups (the world group or a gloo twin of it):
a barrier over every rank of the job, which the step loop must not take every step.

`syncs_per_step` runs the real trainer loop (`training.trainer.train`: stop flag, async checkpoint
commit, bad-step checks, logging) in the rank pool and attributes each event to the step whose
`optimizer_step` call it follows.
"""

from __future__ import annotations

import dataclasses
import traceback
from contextlib import ExitStack
from unittest import mock

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megaframe.parallel.mesh import Axis

aten = torch.ops.aten
READS = {aten._local_scalar_dense.default}
DATA_DEPENDENT = {
    aten.nonzero.default,
    aten.bincount.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.nonzero_static.default,
}
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "all_to_all_single",
    "reduce_scatter_tensor",
    "gather_object",
)


def _where() -> str:
    """The innermost megaframe frame of the current stack (file:line), for the report."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/megaframe/" in frame.filename:
            return f"{frame.filename.split('/megaframe/')[-1]}:{frame.lineno}"
    return "?"


class _Dispatch(TorchDispatchMode):
    def __init__(self, note):
        super().__init__()
        self.note = note

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READS or func in DATA_DEPENDENT:
            self.note(str(func.overloadpacket.__name__))
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.note("repeat_interleave without output_size")
        elif func is aten.index.Tensor and any(
            i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        ):
            self.note("boolean-mask index")
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, note):
        super().__init__()
        self.note = note

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("tolist", "numpy"):
            self.note(name)
        elif func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
            self.note(f"torch.{name}(python data, device=...)")
        return func(*args, **kwargs)


class SyncCounter:
    """`with SyncCounter(mesh) as c:` ... c.mark() at each step start; c.steps: per step, the events."""

    def __init__(self, mesh):
        # every axis of the mesh (tp, pp, dp, ep, cp, the experts' and HSDP's, ep_node and ep_rail)
        axes = [getattr(mesh, f.name) for f in dataclasses.fields(mesh)]
        self.axis_groups = {id(a.group) for a in axes if isinstance(a, Axis) and a.group is not None}
        self.steps: list[dict[str, list[str]]] = [{"syncs": [], "world": []}]
        self._stack = ExitStack()

    def mark(self) -> None:
        self.steps.append({"syncs": [], "world": []})

    def _note_sync(self, what: str) -> None:
        self.steps[-1]["syncs"].append(f"{what} @ {_where()}")

    def _wrap(self, name: str):
        real = getattr(dist, name)

        def counted(*args, **kwargs):
            group = kwargs.get("group")
            if id(group) not in self.axis_groups:
                self.steps[-1]["world"].append(f"{name} @ {_where()}")
            return real(*args, **kwargs)

        return counted

    def __enter__(self):
        for name in COLLECTIVES:
            self._stack.enter_context(mock.patch.object(dist, name, self._wrap(name)))
        self._stack.enter_context(_Function(self._note_sync))
        self._stack.enter_context(_Dispatch(self._note_sync))
        return self

    def __exit__(self, *exc):
        self._stack.close()


def syncs_per_step(mesh, overrides: list[str], steps: int, run_dir: str) -> dict | None:
    """Train `steps` steps with the real trainer loop; rank 0 returns, per step, the most sync events of
    any rank and the world collectives, with where they happened."""
    from megaframe.runops.signals import StopFlag
    from megaframe.training import trainer
    from tests.distributed.cases import job_config

    cfg = job_config(
        mesh,
        overrides
        + [
            f"train.max_steps={steps}",
            f"train.log_interval={steps}",
            "train.hang_timeout_s=0",
            f"run.dir={run_dir}",
            f"checkpoint.dir={run_dir}/checkpoints",
        ],
    )
    counter = SyncCounter(mesh)
    real_step, real_bad = trainer.optimizer_step, trainer.BadSteps

    def bad_steps(limit, verbose, defer=False):
        """On CPU the trainer reads grad norms every step (free there), on CUDA at log steps only:
        count the CUDA policy."""
        return real_bad(limit, verbose, defer=True)

    def marked(*args, **kwargs):
        counter.mark()
        return real_step(*args, **kwargs)

    with (
        mock.patch.object(trainer, "optimizer_step", marked),
        mock.patch.object(trainer, "BadSteps", bad_steps),
    ):
        with counter:
            trainer.train(cfg, mesh, StopFlag())
    mine = counter.steps[1:]  # [0] is start-up
    every = [None] * mesh.world
    if mesh.group is not None:
        dist.all_gather_object(every, mine, group=mesh.group)
    else:
        every = [mine]
    if mesh.rank != 0:
        return None
    out = {}
    for s in range(steps):
        worst = max((e[s] for e in every), key=lambda d: len(d["syncs"]))
        out[s + 1] = {"syncs": worst["syncs"], "world": max((e[s]["world"] for e in every), key=len)}
    return out
