"""The cpu device's measured gloo link: a real two-process measurement, and the curve's interpolation."""

import pytest

from megaframe.planning.gloo_link import SIZES, hop_seconds, measure_hops, tail_seconds_per_byte
from megaframe.planning.steptime.inputs import ring_seconds


def test_hop_curve_interpolates_log_log_and_extends_by_the_last_bandwidth():
    curve = ((4, 1e-4), (1024, 1e-3), (4096, 2e-3))
    assert hop_seconds(curve, 1) == 1e-4  # below the first point: latency-bound
    assert hop_seconds(curve, 1024) == pytest.approx(1e-3)
    assert hop_seconds(curve, 2048) == pytest.approx(2**0.5 * 1e-3)  # halfway in log-log
    assert hop_seconds(curve, 8192) == pytest.approx(2e-3 + 4096 * 1e-3 / 3072)
    # a ring collective of 3 hops of 1 KiB each on the curve; one rank: free
    assert ring_seconds(3072, 4, 3, bw=1.0, latency=9.0, hops=curve) == pytest.approx(3e-3)
    assert ring_seconds(3072, 1, 3, bw=1.0, latency=9.0, hops=curve) == 0.0
    # noise can leave the largest two hops equal (the curve never falls): the tail then runs at the
    # largest hop's own rate, where it divided by zero (a busy machine's `plan calibrate --quick`)
    flat = ((4, 1e-4), (1024, 2e-3), (4096, 2e-3))
    assert hop_seconds(flat, 8192) == pytest.approx(2e-3 + 4096 * 2e-3 / 4096)
    assert tail_seconds_per_byte(flat) == pytest.approx(2e-3 / 4096)


def test_measured_hops_cover_the_sizes_and_never_fall():
    curve = measure_hops()
    assert [s for s, _ in curve] == list(SIZES)
    times = [t for _, t in curve]
    assert all(t > 0 for t in times) and times == sorted(times)
