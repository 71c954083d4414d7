"""Naming the rank the others wait for from each rank's holds in its collectives (runops/arrivals.py), on
synthetic holds: a rank late once a step among many near-ties, noise alone, pp's drain, persistence."""

from __future__ import annotations

import random

from megaframe.runops import arrivals

TP = ("tp", (0, 1))
PP = ("pp", (0, 1))


def _holds(late_rank, steps=4, per_step=50, lag=0.2, noise=0.002, seed=0):
    """Two ranks' holds at `per_step` tp collectives a step; `late_rank` (None: no one) arrives `lag` s late
    at each step's first one (the others start together: noise only)."""
    rng = random.Random(seed)
    every = [{TP: []}, {TP: []}]
    for _ in range(steps):
        for k in range(per_step):
            held = [rng.uniform(0, noise), rng.uniform(0, noise)]
            if k == 0 and late_rank is not None:
                held[1 - late_rank] += lag  # the early rank waits for the late one
            for r in (0, 1):
                every[r][TP].append(held[r])
    return every


def test_a_rank_late_once_a_step_is_named_though_it_is_last_at_half_the_collectives():
    row, named = arrivals.window(_holds(late_rank=1), steps=4, step_time=0.5)
    assert row["straggler/last_arrival_rank"] == 1 and row["straggler/tp/last_arrival_rank"] == 1
    assert row["straggler/last_arrival_share"] > 0.9
    assert 0.2 <= row["straggler/last_arrival_lag_s"] < 0.23  # the lag, and its share of the noise
    assert named[0] == 1 and named[1] == TP


def test_noise_alone_names_no_rank():
    for seed in range(20):
        row, named = arrivals.window(_holds(late_rank=None, seed=seed), steps=4, step_time=0.5)
        assert row["straggler/last_arrival_rank"] == -1 and named is None, seed


def test_the_pipeline_drain_is_reported_under_pp_but_names_no_straggler():
    every = _holds(late_rank=None)
    for r in (0, 1):  # stage 0 finishes its last backward after stage 1, every step
        every[r][PP] = [0.0 if r == 0 else 0.1] * 4
    row, named = arrivals.window(every, steps=4, step_time=0.5)
    assert row["straggler/pp/last_arrival_rank"] == 0
    assert row["straggler/last_arrival_rank"] == -1 and named is None


def test_the_warning_comes_once_the_same_rank_persists():
    p = arrivals.Persistence()
    named = (1, TP, 0.2)
    assert p.update(named, ["h0", "h1"], 10) is None
    line = p.update(named, ["h0", "h1"], 20)
    assert line and "rank 1 (host h1)" in line and "tp group (ranks 0, 1)" in line and "0.200s" in line
    assert p.update(named, ["h0", "h1"], 30) is None  # not every window
    assert p.update(None, ["h0", "h1"], 40) is None and p.count == 0


def test_the_next_stage_of_a_slow_rank_is_not_blamed_for_the_lateness_it_inherited():
    """pp2 x dp2: rank 1 (stage 0) is slow; rank 3 (stage 1, its pipeline peer) waits for its activations
    and so reaches its own dp collective late by as much, but it waited that much longer for transfers."""
    steps = 4
    every = [{("dp", (0, 1)): [], ("dp", (2, 3)): []} for _ in range(4)]
    for _ in range(steps):
        for r, held in ((0, 0.5), (1, 0.0), (2, 0.5), (3, 0.0)):
            every[r][("dp", (0, 1)) if r < 2 else ("dp", (2, 3))].append(held)
    for r in range(4):
        every[r] = {k: v for k, v in every[r].items() if r in k[1]}
    p2p = [0.1 * steps, 0.1 * steps, 0.1 * steps, 0.6 * steps]
    assert arrivals.window(every, steps, 1.0)[0]["straggler/last_arrival_rank"] == -1  # 1 and 3 tie
    row, named = arrivals.window(every, steps, 1.0, p2p)
    assert row["straggler/last_arrival_rank"] == 1 and named[1] == ("dp", (0, 1))
