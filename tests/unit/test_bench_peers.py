"""benchmarks/bench_gpu.py, the fair one-GPU comparison,
runs its harness on CPU (--dry) and reports every peer."""

import re
import sys

import torch

from megaframe.config import ROOT
from tests.e2e.helpers import run


def test_bench_gpu_dry_reports_megaframe_transformers_and_torchtitan():
    # a fork of the suite's warm interpreter (tests/e2e/warm_start.py): the subject is the harness's lines
    res = run([sys.executable, str(ROOT / "benchmarks/bench_gpu.py"), "--dry", "--fp8"], 600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = res.stdout
    assert "2 micro-batches x 1 x 32 tokens per step" in out and "(6 N_matmul + 12 L S H E)" in out
    figure = (
        r"tokens/s +[0-9.]+ \| MFU [0-9.]+ \| peak .* GiB \| per step [0-9.]+ ms "
        r"\+ per micro-batch [0-9.]+ ms \| syncs/step in the timed loop 0 \|"
    )
    for side in ("megaframe", "hf_llama", "megaframe_fp8", "hf_llama_fp8"):
        # one line per figure, naming the device and torch's version
        assert re.search(rf"{side} +{figure} .* \| cpu, torch {re.escape(torch.__version__)}\n", out), out
    # the float8 peer: torchao on every block linear (7 per layer, 2 layers), the head kept bf16
    assert "torchao" in out and "float8 tensorwise on 14 linears" in out, out
    # torchtitan needs triton (CUDA torch): on a CPU-only torch it says why it is left out
    assert re.search(rf"torchtitan +({figure}|SKIP: not importable)", out), out
    assert re.search(r"ratio megaframe / hf_llama: [0-9.]+", out), out
    assert re.search(r"ratio hf_llama_fp8 / hf_llama: [0-9.]+", out), out


def _bench_gpu():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks/bench_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_times_tokens_per_second_with_no_sync_inside_the_timed_loop(monkeypatch):
    """The rate is timed over whole optimizer steps with one sync at the end (float(loss)); the per-step
    split is timed between syncs in a pass of its own. Before: megaframe's zero_grad and step, a peer's
    update, were each wrapped in two syncs inside the timed loop (4 and 2 per step)."""
    from types import SimpleNamespace

    bench = _bench_gpu()
    events = []
    monkeypatch.setattr(bench.Clock, "sync", lambda self: events.append("sync"))

    class Loss:
        def __float__(self):
            events.append("float")
            return 0.0

    def build(clock):
        zero_grad, update = clock.wrap(lambda: None), clock.wrap(lambda: None)

        def step(mbs):
            events.append("step")
            zero_grad()
            update()
            return Loss()

        return step, "a side whose zero_grad and update are wrapped as megaframe's are"

    args = SimpleNamespace(warmup=1, repeats=2, micro_batches=2, batch=1, seq=4)
    r = bench.measure(build, args, torch.device("cpu"), [None] * 4)
    first = [i for i, e in enumerate(events) if e == "step"][args.warmup]
    timed = events[first : events.index("float", first)]
    assert timed.count("step") == 3 and timed.count("sync") == 0, timed
    assert r["step_ms"] >= 0 and r["mb_ms"] >= 0 and "sync" in events[events.index("float", first) :]


def test_bench_refuses_an_unknown_side(capsys):
    assert _bench_gpu().main(["--dry", "--sides", "megaframe,bogus"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sides megaframe,bogus: unknown bogus" in err[0], err
