"""parallel.tp_comm_overlap: the sp all-gather / reduce-scatter chunked under the GEMMs gives the
unoverlapped path's losses and grads (fp32, 1e-6) at tp2·sp and tp4·sp, with the same bytes on the tp axis."""

import pytest
import torch

from tests.distributed.cases import train_and_report

pytestmark = pytest.mark.distributed

STEPS = 3
_plain: dict = {}


@pytest.mark.parametrize("tp,chunks", [(2, 4), (4, 2), (2, 3)], ids=["tp2-k4", "tp4-k2", "tp2-k3"])
def test_overlap_equals_the_unoverlapped_path(pool, tp, chunks):
    over = [f"parallel.tp={tp}", "parallel.sp=true"]
    if tp not in _plain:
        _plain[tp] = pool.run(train_and_report, tp, over, STEPS, tp=tp)[0]
    plain = _plain[tp]
    got = pool.run(
        train_and_report,
        tp,
        over + ["parallel.tp_comm_overlap=true", f"parallel.tp_comm_chunks={chunks}"],
        STEPS,
        tp=tp,
    )[0]
    rel = [abs(a - b) / abs(b) for a, b in zip(got["losses"], plain["losses"])]
    assert max(rel) <= 1e-6, (got["losses"], plain["losses"])
    for k in plain["grads"]:
        torch.testing.assert_close(got["grads"][k], plain["grads"][k], rtol=1e-5, atol=1e-7)
    # the same bytes cross the tp axis, only in chunks (the step's tp traffic per step, from CommStats)
    tp_bytes = [
        {k: v for k, v in c.items() if k.startswith("tp")} for c in (got["comm"][-1], plain["comm"][-1])
    ]
    assert tp_bytes[0] == pytest.approx(tp_bytes[1], rel=1e-9), tp_bytes


def test_build_model_sets_every_sp_linear_to_overlap():
    """Every tp linear of a tp2·sp model takes the overlapped path (4 per block), and a bad setting is one
    line."""
    from megaframe.config import ConfigError
    from megaframe.layers.linear import ColumnParallelLinear, RowParallelLinear
    from megaframe.parallel.virtual import virtual_mesh
    from tests.distributed.cases import tiny_config
    from tests.forms import build_model

    cfg = tiny_config(["parallel.tp=2", "parallel.sp=true", "parallel.tp_comm_overlap=true"], 2)
    model = build_model(cfg, virtual_mesh(2, 1, 1))
    tp_linears = [
        m for m in model.layers.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    ]
    assert len(tp_linears) == 4 * cfg.model.num_layers and all(m.overlap_chunks == 4 for m in tp_linears)
    with pytest.raises(ConfigError, match="parallel.tp_comm_overlap=true .* needs parallel.sp=true"):
        tiny_config(["parallel.tp=2", "parallel.tp_comm_overlap=true"], 2)


def test_bench_tp_overlap_prints_its_ratio():
    import sys

    from megaframe.config import ROOT
    from tests.e2e.helpers import run

    # a fork of the e2e helpers' warm interpreter: the subject is the benchmark (which starts its own
    # ranks), not the start of the interpreter that launches them
    res = run(
        [
            sys.executable,
            str(ROOT / "benchmarks/bench_tp_overlap.py"),
            "seq=64",
            "hidden=64",
            "layers=1",
            "steps=1",
        ],
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "ratio unoverlapped / overlapped:" in res.stdout
