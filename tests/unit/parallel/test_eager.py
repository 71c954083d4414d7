"""The compiler is imported only when something compiles: importing megaframe's commands, building a model,
a forward and backward through the parallel layers, and the phase meter's CPU profile leave torch._dynamo
and torch._inductor unimported (they cost about a third of a one-step run's CPU time). torch.optim's
own step imports dynamo (torch's `_use_grad_for_differentiable`), so a training step still pays it; the
commands that never step (plan, generate, evaluate, a refused config) do not. `arm()` then turns every
eager callable into a graph break, those made later included."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

CHILD = """
import sys
import torch
import megaframe.evaluate, megaframe.generate, megaframe.plan, megaframe.training.trainer  # noqa: F401
from megaframe.config import load_config
from tests.forms import build_model
from megaframe.parallel.mesh import single_process_mesh
from megaframe.training.phase_meter import PhaseMeter

cfg = load_config(["parallel.sp=false", "model.num_layers=2"], world_size=1, check_data=False)
model = build_model(cfg, single_process_mesh())
meter = PhaseMeter(torch.device("cpu"))
ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length))
with meter.phase("step"):
    model(ids, ids).mean().backward()
assert meter.figures["step"] > 0
loaded = sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor")))
print("compiler modules:", len(loaded), loaded[:3])

from megaframe.parallel import comm, eager
eager.arm()
late = eager.eager(lambda x: x + 1)
assert all(getattr(e.target, "_torchdynamo_disable", False) for e in (*comm._eager.values(), late))
assert late(1) == 2
print("armed")
"""


def test_no_compiler_import_until_something_compiles():
    res = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "compiler modules: 0 []" in res.stdout, res.stdout
    assert "armed" in res.stdout
