"""The trainer's per-phase memory meter on CPU (training/phase_meter.py): a phase's peak is what the rank held
when it began plus the most the allocator handed out during it; each phase measured once; a profiler the
user runs is left alone."""

import torch
from torch.profiler import ProfilerActivity, profile

from megaframe.training.phase_meter import PhaseMeter, key


def test_peak_counts_transients_freed_inside_the_phase():
    meter = PhaseMeter(torch.device("cpu"))
    with meter.phase("step"):
        a = torch.empty(1 << 20, dtype=torch.uint8)  # 1 MiB held at the peak, then freed
        b = torch.empty(1 << 19, dtype=torch.uint8)
        del a, b
        c = torch.empty(1 << 10, dtype=torch.uint8)
    assert meter.figures["step"] == (1 << 20) + (1 << 19)
    with meter.phase("step"):  # measured once: a second entry changes nothing
        torch.empty(1 << 22, dtype=torch.uint8)
    assert meter.take() == {key("step"): (1 << 20) + (1 << 19)} and meter.take() == {}
    assert "step 1.5 MiB" in meter.summary()
    del c


def test_baseline_is_the_tracked_state_and_a_user_profiler_is_left_alone():
    model = torch.nn.Linear(256, 256, bias=False)  # 256 KiB of fp32 weight

    class Optim:
        def memory_bytes(self):
            return {"mem/grads_bytes": 0, "mem/optim_bytes": 1000}

    meter = PhaseMeter(torch.device("cpu"))
    meter.track(model, Optim())
    with meter.phase("save"):
        torch.empty(4096, dtype=torch.uint8)
    assert meter.figures["save"] == 256 * 256 * 4 + 1000 + 4096
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with meter.phase("load"):
            torch.ones(8)
        torch.ones(8)
    assert "load" not in meter.figures and any(e.name == "aten::ones" for e in prof.events())
