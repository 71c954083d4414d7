"""Schedules as data, checked without processes: ordering, matching, deadlock freedom, memory, bubble."""

import itertools

import pytest

from megaframe.pipeline.grouping import build_schedule
from megaframe.pipeline.partition import stage_counts, stage_layout
from megaframe.pipeline.schedule import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    Grouping,
    activation_bound,
    check_args,
    compute_order,
)
from megaframe.pipeline.simulate import ScheduleError, SendModel, bubble_formula, simulate

GRID = [
    (kind, pp, vpp, m)
    for pp, vpp, m in itertools.product([1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 4, 6, 8, 12])
    for kind in ("gpipe", "1f1b", "interleaved")
    if not (kind == "1f1b" and vpp > 1)
    and not (kind == "interleaved" and (vpp < 2 or m % pp))
    and not (vpp > 1 and pp == 1)
]


@pytest.mark.parametrize("sends", list(SendModel), ids=[s.value for s in SendModel])
@pytest.mark.parametrize("kind,pp,vpp,m", GRID, ids=[f"{k}-pp{p}-vpp{v}-m{m}" for k, p, v, m in GRID])
def test_simulator_accepts_every_schedule(kind, pp, vpp, m, sends):
    """Buffered (gloo) and rendezvous (NCCL) sends: no deadlock, the bubble of the formula either way,
    with backward as long as forward and twice as long (the receives posted early cost no idle time)."""
    for backward_time in (1, 2):
        res = simulate(kind, pp, vpp, m, sends, backward_time=backward_time)  # raises on mismatch, deadlock,
        if kind == "gpipe" and vpp > 1 and m < pp:  # B before F, or memory over bound; gpipe's chunk 1
            assert res.bubble > bubble_formula(pp, vpp, m)  # waits for the last rank's chunk 0
        else:
            assert res.bubble == pytest.approx(bubble_formula(pp, vpp, m), abs=1e-12)
        for r in range(pp):
            assert res.peak_inflight[r] <= activation_bound(kind, pp, vpp, m, r)


def _deadlock_free(grouping: Grouping, sends: SendModel) -> int:
    ok = 0
    for case in GRID:
        try:
            simulate(*case, sends, grouping)
            ok += 1
        except ScheduleError as e:
            assert "deadlock" in str(e), e
    return ok


def test_every_grid_case_is_deadlock_free_under_rendezvous_and_the_old_grouping_is_not():
    """The count the issue asks for; and the checker bites: receives posted right before their compute
    (the grouping before the pairing) deadlock interleaved and gpipe vpp>1 under NCCL's rendezvous sends,
    though gloo's buffered sends hide it."""
    assert len(GRID) == 120
    assert _deadlock_free(Grouping.PAIRED, SendModel.RENDEZVOUS) == 120
    assert _deadlock_free(Grouping.ADJACENT, SendModel.BUFFERED) == 120
    assert _deadlock_free(Grouping.ADJACENT, SendModel.RENDEZVOUS) == 86
    with pytest.raises(ScheduleError, match="deadlock"):  # the review's example, at the first steady backward
        simulate("interleaved", 4, 2, 64, SendModel.RENDEZVOUS, Grouping.ADJACENT)
    simulate("interleaved", 4, 2, 64, SendModel.RENDEZVOUS)
    for pp, m in [(2, 2), (2, 8), (4, 4), (4, 12)]:  # 1F1B is safe either way (its batches already pair)
        simulate("1f1b", pp, 1, m, SendModel.RENDEZVOUS, Grouping.ADJACENT)


def test_interleaved_bubble_equals_formula_pp4_vpp2_m8():
    res = simulate("interleaved", 4, 2, 8)
    assert res.bubble == pytest.approx(3 / (2 * 8 + 3))
    plain = simulate("1f1b", 4, 1, 8)
    assert plain.bubble == pytest.approx(3 / (8 + 3)) and res.bubble < plain.bubble


def test_1f1b_holds_at_most_pp_minus_rank_activations():
    res = simulate("1f1b", 4, 1, 8)
    assert res.peak_inflight == [4, 3, 2, 1]
    assert simulate("gpipe", 4, 1, 8).peak_inflight == [8, 8, 8, 8]


def test_1f1b_order_of_the_last_rank_alternates():
    order = [(a.kind, a.microbatch) for a in compute_order("1f1b", 4, 1, 4, 3)]
    assert order == [(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2), (F, 3), (B, 3)]
    first = [(a.kind, a.microbatch) for a in compute_order("1f1b", 4, 1, 4, 0)]
    assert first[:4] == [(F, 0), (F, 1), (F, 2), (F, 3)] and first[4:] == [(B, 0), (B, 1), (B, 2), (B, 3)]


def test_interleaved_visits_chunks_in_groups_of_pp():
    order = [(a.kind, a.microbatch, a.chunk) for a in compute_order("interleaved", 2, 2, 4, 0) if a.kind == F]
    assert order == [(F, 0, 0), (F, 1, 0), (F, 0, 1), (F, 1, 1), (F, 2, 0), (F, 3, 0), (F, 2, 1), (F, 3, 1)]


def test_communication_surrounds_compute():
    sched = build_schedule("1f1b", 2, 1, 2, 0)
    kinds = [a.kind for a in sched]
    assert kinds == [F, SEND_F, F, SEND_F, RECV_B, B, RECV_B, B]
    last = build_schedule("1f1b", 2, 1, 2, 1, Grouping.ADJACENT)
    assert [a.kind for a in last] == [RECV_F, F, B, SEND_B, RECV_F, F, B, SEND_B]
    # paired: micro-batch 1's input is received when rank 0 sends it, before B0 (the last rank's
    # send_backward_recv_forward, one batch earlier)
    last = build_schedule("1f1b", 2, 1, 2, 1)
    assert [a.kind for a in last] == [RECV_F, F, RECV_F, B, SEND_B, F, B, SEND_B]
    assert all(a.peer == 0 for a in last if a.kind not in (F, B))


def test_simulator_catches_a_broken_schedule(monkeypatch):
    import megaframe.pipeline.simulate as sim

    def swapped(kind, pp, vpp, m, rank, grouping):
        s = build_schedule(kind, pp, vpp, m, rank, grouping)
        if rank == 1:  # receive micro-batch 1 before 0: mismatched order
            i, j = [k for k, a in enumerate(s) if a.kind == RECV_F][:2]
            s[i], s[j] = s[j], s[i]
        return s

    monkeypatch.setattr(sim, "build_schedule", swapped)
    with pytest.raises(ScheduleError):
        sim.simulate("1f1b", 2, 1, 4)

    def backward_first(kind, pp, vpp, m, rank, grouping):
        return [Action(B, 0, 0)] + build_schedule(kind, pp, vpp, m, rank, grouping)

    monkeypatch.setattr(sim, "build_schedule", backward_first)
    with pytest.raises(ScheduleError):
        sim.simulate("1f1b", 1, 1, 2)


@pytest.mark.parametrize(
    "kind,pp,vpp,m,needle",
    [
        ("interleaved", 4, 2, 6, "multiple"),
        ("1f1b", 2, 2, 4, "vpp"),
        ("interleaved", 2, 1, 4, "vpp"),
        ("zigzag", 2, 1, 4, "pp_schedule"),
    ],
)
def test_impossible_schedules_are_refused(kind, pp, vpp, m, needle):
    with pytest.raises(ValueError, match=needle):
        check_args(kind, pp, vpp, m)


def test_stage_layout_loop_order_and_uneven_split():
    # chunk c of rank r holds layer block r + c*pp
    assert stage_layout(8, 2, 2, 0).chunks == ((0, 1), (4, 5))
    assert stage_layout(8, 2, 2, 1).chunks == ((2, 3), (6, 7))
    s = stage_layout(5, 2, 1, 0, layout=[3, 2])
    assert s.chunks == ((0, 1, 2),) and s.first and not s.last
    with pytest.raises(ValueError, match="pp_layout"):
        stage_counts(5, 2, 1, [3, 3])
    with pytest.raises(ValueError, match="num_layers"):
        stage_counts(5, 2, 1)


@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 1), (2, 2, 3), (4, 2, 8), (4, 3, 2), (3, 1, 5)])
def test_forward_schedule_is_deadlock_free_under_rendezvous(pp, vpp, m):
    """Evaluation's forward-only schedule: every forward once, paired sends/receives that meet."""
    from megaframe.pipeline.grouping import forward_schedule
    from megaframe.pipeline.schedule import RECV_F, SEND_F, F, stage_of

    scheds = [forward_schedule(pp, vpp, m, r) for r in range(pp)]
    for r, s in enumerate(scheds):
        assert sorted((a.microbatch, a.chunk) for a in s if a.kind == F) == [
            (mb, c) for mb in range(m) for c in range(vpp)
        ]
        sends = [(a.microbatch, stage_of(r, a.chunk, pp)) for a in s if a.kind == SEND_F]
        recvs = [
            (a.microbatch, stage_of((r + 1) % pp, a.chunk, pp) - 1)
            for a in scheds[(r + 1) % pp]
            if a.kind == RECV_F
        ]
        assert sends == recvs  # the same messages in the same order on each channel


@pytest.mark.parametrize("pp,m", [(4, 8), (8, 16)])
def test_zero_bubble_idle_time_and_memory_against_1f1b(pp, m, capsys):
    """F:B:W = 1:1:1, compared as idle time at equal work (1F1B's B is B+W = 2 units; a zbv chunk is half
    a stage): zb_h1 idles a third of 1F1B, zbv a sixth. As idle/makespan the ratios are larger (printed).
    F->B activations: zb_h1 per rank as 1F1B's; zbv, in stage units, never above 1F1B's largest rank."""
    from megaframe.pipeline.simulate import Costs

    res = {
        k: simulate(k, pp, 2 if k == "zbv" else 1, m, SendModel.RENDEZVOUS, costs=Costs(1, 1, 1))
        for k in ("1f1b", "zb_h1", "zbv")
    }
    base = res["1f1b"]
    assert res["zb_h1"].idle <= 0.40 * base.idle and res["zbv"].idle <= 0.20 * base.idle
    assert res["zb_h1"].idle == pytest.approx(base.idle / 3) and res["zbv"].idle == pytest.approx(
        base.idle / 6
    )
    assert all(z <= o for z, o in zip(res["zb_h1"].peak_inflight_stages, base.peak_inflight_stages))
    assert max(res["zbv"].peak_inflight_stages) <= max(base.peak_inflight_stages)
    assert max(res["zb_h1"].peak_pending_w) == pp and max(res["zbv"].peak_pending_w) == 2 * pp
    with capsys.disabled():
        print(
            f"\npp{pp} m{m} idle time (1f1b/zb_h1/zbv): {base.idle}/{res['zb_h1'].idle}/{res['zbv'].idle}; "
            f"idle/makespan: {base.bubble:.3f}/{res['zb_h1'].bubble:.3f}/{res['zbv'].bubble:.3f}"
        )


def test_zero_bubble_grid_is_deadlock_free_under_both_send_models():
    """Every pp <= 8, m <= 64 of zb_h1 and zbv: messages matched, no deadlock under rendezvous (NCCL) or
    buffered (gloo) sends, every F, B and W once, memory within its bounds (simulate raises otherwise)."""
    for kind, vpp in (("zb_h1", 1), ("zbv", 2)):
        for pp in range(1, 9):
            for m in range(1, 65):
                for sends in SendModel:
                    simulate(kind, pp, vpp, m, sends)


@pytest.mark.parametrize("kind,pp,m", [("zb_h1", 4, 8), ("zbv", 4, 8), ("zbv", 3, 5), ("zb_h1", 8, 13)])
def test_greedy_ticks_are_the_unit_time_replay(kind, pp, m):
    """_unit_times reuses the greedy scheduler's ticks for the zero-bubble kinds: they are what replaying
    its orders in unit time gives."""
    from megaframe.pipeline.grouping import _replay_unit_times, _unit_times

    assert _unit_times(kind, pp, 2 if kind == "zbv" else 1, m) == _replay_unit_times(
        kind, pp, 2 if kind == "zbv" else 1, m
    )


def test_costs_time_the_unit_orders():
    """Given costs time the same orders: unsplit kinds run B + W as one B (1f1b with F:B:W = 1:1:0 is the
    old backward_time=1); measured-looking floats stay deadlock-free and every rank does the same work."""
    from megaframe.pipeline.simulate import Costs

    assert simulate("1f1b", 4, 1, 8, costs=Costs(1, 1, 0)).bubble == pytest.approx(bubble_formula(4, 1, 8))
    assert (
        simulate("1f1b", 4, 1, 8, costs=Costs(1, 1, 1)).makespan
        == simulate("1f1b", 4, 1, 8, backward_time=2).makespan
    )
    for kind, vpp in (("zb_h1", 1), ("zbv", 2), ("interleaved", 2)):
        res = simulate(kind, 4, vpp, 8, SendModel.RENDEZVOUS, costs=Costs(1.0, 1.3, 0.7))
        assert res.idle == pytest.approx(res.makespan - 3.0 * 8) and 0 < res.bubble < 0.3


def test_plot_schedule_draws_f_b_w_and_prints_the_bubble(tmp_path, capsys):
    """scripts/plot_schedule.py kind=zb_h1: F, B and W in
    three colours, `bubble=` printed; bad input exits 2."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "plot_schedule", Path(__file__).parents[3] / "scripts" / "plot_schedule.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    drawn = []
    real = mod.plt.Axes.barh
    mod.plt.Axes.barh = lambda self, *a, **k: drawn.append(k["color"]) or real(self, *a, **k)
    try:
        mod.main(["pp=2", "microbatches=4", "kind=zb_h1", f"out={tmp_path / 's.png'}"])
    finally:
        mod.plt.Axes.barh = real
    assert {mod.COLOURS[k][0] for k in "FBW"} == set(drawn)
    out = capsys.readouterr().out
    assert "zb_h1 pp=2 vpp=1 m=4 bubble=0.0769" in out
    assert f"plot_schedule: wrote {tmp_path / 's.png'}" in out  # the path written, not silence
    # the legend names only what is drawn: interleaved has no W, zbv's chunks are 0 and 1
    runs = [mod.simulate("interleaved", 4, 2, 8), mod.simulate("zbv", 4, 2, 8)]
    assert [label for label, _ in mod.legend_entries(runs[:1])] == [
        "F chunk 0",
        "F chunk 1",
        "B chunk 0",
        "B chunk 1",
    ]
    assert [label for label, _ in mod.legend_entries(runs[1:])][-2:] == ["W chunk 0", "W chunk 1"]
    with pytest.raises(SystemExit) as e:
        mod.main(["kind=zbv", "vpp=1"])
    assert e.value.code == 2 and "vpp=1" in capsys.readouterr().err


def test_stage_layout_v_places_both_ends_on_rank_0():
    # zbv: rank r holds stage r (chunk 0) and stage 2pp-1-r (chunk 1); the uneven layout by stage
    counts = [1, 2, 1, 1, 1, 1, 2, 1]  # stages 0..7 at pp=4
    s0, s3 = (stage_layout(10, 4, 2, r, layout=counts, v=True) for r in (0, 3))
    assert s0.chunks == ((0,), (9,)) and s0.first and s0.last and s0.v
    assert s3.chunks == ((4,), (5,)) and not s3.first and not s3.last


OVERLAP_GRID = [("1f1b_overlap", 1, 1, m) for m in (1, 2, 5)] + [
    ("interleaved_overlap", pp, vpp, m)
    for pp, vpp, m in itertools.product([2, 3, 4], [2, 3], [2, 3, 4, 6, 8, 12])
    if m % pp == 0
]


@pytest.mark.parametrize(
    "kind,pp,vpp,m", OVERLAP_GRID, ids=[f"{k}-pp{p}-vpp{v}-m{m}" for k, p, v, m in OVERLAP_GRID]
)
def test_overlapped_kinds_pair_steady_forwards_with_backwards_and_keep_the_bubble(kind, pp, vpp, m):
    """Each pair is a forward and the backward right after it in the action list (nothing to send or
    receive between: the executor runs them at once), of different micro-batches; no deadlock under either
    send model (the last warm-up forward would close a cycle through the later stages if paired), the
    activations within the bound (one forward more than the base kind), and the base kind's bubble."""
    from megaframe.pipeline.schedule import paired_forwards

    pairs = 0
    for rank in range(pp):
        actions, order = build_schedule(kind, pp, vpp, m, rank), compute_order(kind, pp, vpp, m, rank)
        compute = [i for i, a in enumerate(actions) if a.kind in (F, B)]
        for n in paired_forwards(kind, pp, vpp, m, rank):
            f, b = order[n], order[n + 1]
            assert f.kind == F and b.kind == B and f.microbatch != b.microbatch
            assert compute[n + 1] == compute[n] + 1, (rank, f, b)  # adjacent: no transfer between
            pairs += 1
    assert pairs > 0 or m * vpp <= 2 * pp  # a steady state where there are enough micro-batches
    for sends in SendModel:
        res = simulate(kind, pp, vpp, m, sends)
        assert res.bubble == pytest.approx(bubble_formula(pp, vpp, m), abs=1e-12)
        for r in range(pp):
            assert res.peak_inflight[r] <= activation_bound(kind, pp, vpp, m, r)
            base = "1f1b" if kind == "1f1b_overlap" else "interleaved"
            assert activation_bound(kind, pp, vpp, m, r) <= activation_bound(base, pp, vpp, m, r) + 1


def test_a_pipelined_1f1b_overlap_is_refused_towards_the_interleaved_one():
    with pytest.raises(ValueError, match="at pp=2 use interleaved_overlap"):
        check_args("1f1b_overlap", 2, 1, 4)
