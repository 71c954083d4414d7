"""Pipeline schedules are registered specs chosen by name: each kind carries its chunk rule, placement,
split backward, order, warm-up and memory bound, and a new kind runs through the same paths by name."""

from __future__ import annotations

import pytest

from megaframe.pipeline import schedule
from megaframe.pipeline.grouping import build_schedule
from megaframe.pipeline.schedule import (
    SCHEDULES,
    F,
    ScheduleSpec,
    activation_bound,
    check_args,
    compute_order,
    num_warmup,
    register,
    schedule_spec,
)
from megaframe.pipeline.simulate import SendModel, simulate


def test_every_kind_is_a_registered_spec():
    assert set(SCHEDULES) == {
        "gpipe",
        "1f1b",
        "interleaved",
        "zb_h1",
        "zbv",
        "1f1b_overlap",
        "interleaved_overlap",
    }
    assert [k for k, s in SCHEDULES.items() if s.overlap] == ["1f1b_overlap", "interleaved_overlap"]
    assert [k for k in SCHEDULES if schedule.splits_backward(k)] == ["zb_h1", "zbv"]
    assert [k for k, s in SCHEDULES.items() if s.v] == ["zbv"]
    assert [k for k, s in SCHEDULES.items() if s.searched] == ["zb_h1", "zbv"]


def test_the_config_choices_are_the_registered_kinds():
    """config/choices.py (a schema leaf: it cannot import the registry) lists the names Hydra accepts for
    parallel.pp_schedule: exactly the registered specs and auto."""
    from megaframe.config.choices import ScheduleKind

    assert [k.value for k in ScheduleKind] == ["auto", *SCHEDULES]


def test_a_taken_name_or_a_split_kind_without_its_w_bound_is_refused():
    def spec(name, **kw):
        rule = lambda *a: None  # noqa: E731
        return ScheduleSpec(name=name, chunk_rule=rule, order=rule, warmup=rule, bound=rule, **kw)

    for name in ("zb_h1", "auto"):
        with pytest.raises(ValueError, match=f"{name!r} is already registered"):
            register(spec(name))
    with pytest.raises(ValueError, match="give its pending_w bound"):
        register(spec("split_unbounded", split_backward=True))
    assert "split_unbounded" not in SCHEDULES and SCHEDULES["zb_h1"].split_backward


def test_a_spec_is_built_by_keywords():
    """Positional booleans (v, split_backward) read alike at the call site: a spec names every field."""
    with pytest.raises(TypeError):
        ScheduleSpec("x", lambda pp, vpp, m: None, False, False, None, None, None)


@pytest.mark.parametrize(
    "kind,vpp,name", [("auto", 1, "1f1b"), ("auto", 3, "interleaved"), ("zb_h1", 1, "zb_h1")]
)
def test_auto_resolves_by_vpp(kind, vpp, name):
    assert schedule_spec(kind, vpp).name == name


def test_an_unknown_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="parallel.pp_schedule='bogus' must be one of auto, gpipe"):
        schedule_spec("bogus", 1)


@pytest.mark.parametrize(
    "kind,vpp,m,needle",
    [
        ("1f1b", 2, 4, "one chunk per rank"),
        ("zbv", 1, 4, "set parallel.vpp=2 \\(got 1\\)"),
        ("interleaved", 2, 3, "multiple of parallel.pp=2"),
    ],
)
def test_each_spec_keeps_its_chunk_rule(kind, vpp, m, needle):
    with pytest.raises(ValueError, match=needle):
        check_args(kind, 2, vpp, m)


def test_the_warmup_of_a_zero_bubble_order_is_its_forwards_before_the_first_backward():
    for rank in range(4):
        order = compute_order("zb_h1", 4, 1, 8, rank)
        first_b = next(i for i, a in enumerate(order) if a.kind == "B")
        assert num_warmup("zb_h1", 4, 1, 8, rank) == first_b
        assert all(a.kind == F for a in order[:first_b])


@pytest.fixture
def reversed_gpipe():
    """A new kind registered by name: GPipe's forwards with the backwards in forward order."""

    def order(pp, vpp, m, rank):
        return [a for a in compute_order("gpipe", pp, vpp, m, rank) if a.kind == F] + sorted(
            (a for a in compute_order("gpipe", pp, vpp, m, rank) if a.kind != F), key=lambda a: a.microbatch
        )

    spec = register(
        ScheduleSpec(
            name="gpipe_fifo",
            chunk_rule=lambda pp, vpp, m: None if vpp == 1 else "vpp=1 only",
            order=order,
            warmup=lambda pp, vpp, m, rank: m,
            bound=lambda pp, vpp, m, rank: m,
        )
    )
    yield spec
    del SCHEDULES["gpipe_fifo"]


def test_a_registered_kind_runs_by_name_through_the_shared_paths(reversed_gpipe):
    pp, m = 3, 4
    lists = [build_schedule("gpipe_fifo", pp, 1, m, r) for r in range(pp)]
    assert [a.microbatch for a in lists[0] if a.kind == "B"] == [0, 1, 2, 3]
    # every send met under rendezvous sends, no deadlock, every F and B once, within the spec's bound
    simulate("gpipe_fifo", pp, 1, m, SendModel.RENDEZVOUS)
    assert activation_bound("gpipe_fifo", pp, 1, m, 0) == m
    with pytest.raises(ValueError, match="vpp=1 only"):
        check_args("gpipe_fifo", pp, 2, m)
