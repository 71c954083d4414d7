"""The CPU memory profile of a phase (training/phase_meter.py) holds the allocator's events of the rank's own
thread and nothing from gloo's: a collective started inside it must not carry the profile to gloo's worker
thread, where a record closed after the profile ended wrote into freed memory (a native crash of a rank at
random: SIGSEGV in the profiler's `~TorchOpStorage`, or glibc's heap-corruption abort)."""

import pytest
import torch

pytestmark = pytest.mark.distributed

N = 1 << 16


def _collective_inside_a_profile(mesh):
    from megaframe.parallel import comm
    from megaframe.training.phase_meter import allocator_profile, running_peak

    x, out = torch.ones(N), torch.empty(mesh.dp.size * N)
    with allocator_profile() as prof:
        held = torch.ones(N)  # this thread's allocation: the profile's figure
        comm.all_gather_flat(out, x, mesh.dp, async_op=True).wait()
    del held
    events = prof.kineto_results.events()
    gloo = sorted({e.name() for e in events if e.name().startswith("gloo:")})
    return gloo, {e.name() for e in events} - {"[memory]"}, running_peak(prof)


def test_a_collective_inside_a_measured_phase_leaves_gloo_out_of_the_profile(pool):
    for gloo, ops, peak in pool.run(_collective_inside_a_profile, 2):
        assert not gloo, gloo  # before: ["gloo:all_gather"], opened and closed on gloo's worker thread
        assert not ops, ops  # no operator record at all: the allocator's events are all a phase reads
        assert peak >= 4 * N, peak
