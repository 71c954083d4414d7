"""scripts/gpu_figures.py, the prepared one-GPU figures (megaframe against compiled transformers and
torchtitan, bf16 and fp8), runs its harness on CPU (--dry: tiny shapes, aot_eager): every figure asked for
ends in a RESULT line, megaframe's compiled blocks are one graph with no break or recompile, the profiled
figure prints its KERNELS and CATS lines, and the summary its ratios. The transformers and torchtitan
peers' own harness is tests/unit/test_bench_peers.py's; here one peer figure, to keep this cheap."""

import re
import sys

from megaframe.config import ROOT
from tests.e2e.helpers import run

# the scripts run as forks of the suite's warm interpreter (tests/e2e/warm_start.py): their subject is the
# harness and its lines, not the interpreter's start


def test_gpu_figures_dry_runs_megaframe_figures_and_a_peer_on_cpu():
    res = run(
        [sys.executable, str(ROOT / "scripts/gpu_figures.py"), "--dry", "--only", "A mf,A hf-bf16"], 600
    )
    out = res.stdout
    assert res.returncode == 0, out[-3000:] + res.stderr[-2000:]
    for fig in ("A mf-bf16", "A mf-fp8", "A mf-fp8-nohead"):
        line = re.search(rf"RESULT +{fig}: .*", out)
        assert line and "graph breaks 0, graphs 1, recompiles 0" in line.group(0), (fig, out[-3000:])
    assert re.search(r"RESULT +A hf-bf16: [0-9,]+ tok/s", out), out[-3000:]
    assert re.search(r"KERNELS +A mf-bf16: ", out) and re.search(r"CATS +A mf-bf16: ", out), out[-3000:]
    assert "==== SUMMARY" in out and re.search(r"ratio A mf-fp8 / A mf-bf16: [0-9.]+", out), out[-3000:]


def test_gpu_figures_refuses_an_only_that_names_no_figure():
    res = run([sys.executable, str(ROOT / "scripts/gpu_figures.py"), "--dry", "--only", "A mf-bf17"], 600)
    err = [ln for ln in res.stderr.splitlines() if "gpu_figures:" in ln]
    assert res.returncode == 2 and len(err) == 1, res.stderr[-2000:]
    assert "'A mf-bf17' names no figure" in err[0], err
    assert "RESULT" not in res.stdout
