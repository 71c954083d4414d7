"""What a training process imports: a run that does not compile never loads the compiler (torch._dynamo and
inductor cost about as much CPU as torch itself, in every rank of every run)."""
from __future__ import annotations

import pytest

from tests.e2e.helpers import TINY, train

pytestmark = pytest.mark.e2e


def test_a_dp2_run_without_compile_never_imports_the_compiler(tmp_path):
    """dp=2 takes ZeRO's path: AdamW over owned ranges and the weight-grad op into main_grad (layers/wgrad.py),
    each of which imported torch._dynamo through torch's lazy guards. PYTHONPROFILEIMPORTTIME makes every
    process (torchrun's agent and both ranks) list each module it imports on stderr."""
    res = train(["data=synthetic", *TINY, "train.max_steps=2", f"run.dir={tmp_path}"], nproc=2,
                PYTHONPROFILEIMPORTTIME="1")
    assert res.returncode == 0, res.stderr[-3000:]
    imported = {ln.rsplit("|", 1)[1].strip() for ln in res.stderr.splitlines() if ln.startswith("import time:")}
    assert {"torch", "megaframe.layers.wgrad", "megaframe.optim.zero"} <= imported
    assert not {"torch._dynamo", "torch._inductor"} & imported
