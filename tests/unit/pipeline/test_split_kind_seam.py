"""A split-backward kind registered only through the registry API (here: 1F1B's order with each W right
after its B) is treated as the zero-bubble kinds are, by the spec's fields and not by a list of names: the
config checks refuse it under train.compile and fp8 with the same rule, pipeline/partition.py with the
same recompute rules, the simulator holds it to its spec's pending-W bound, and the layout search tries
it (spec.searched) and sizes it with W's pending memory and times it with W's own cost."""

from __future__ import annotations

import pytest

from megaframe.config import ConfigError, load_config, validate
from megaframe.config.derived import settled
from megaframe.pipeline.partition import check_runnable
from megaframe.pipeline.schedule import (
    SCHEDULES,
    Action,
    B,
    ScheduleSpec,
    W,
    compute_order,
    register,
    splits_backward,
)
from megaframe.pipeline.simulate import SendModel, simulate
from megaframe.planning.devices import DEVICES
from megaframe.planning.search.rank import search

TOY = "toy_split"


def _order(pp: int, vpp: int, m: int, rank: int) -> list[Action]:
    out = []
    for a in compute_order("1f1b", pp, vpp, m, rank):
        out += [a, Action(W, a.microbatch, a.chunk)] if a.kind == B else [a]
    return out


@pytest.fixture
def toy_split():
    one = SCHEDULES["1f1b"]
    spec = register(
        ScheduleSpec(
            name=TOY,
            chunk_rule=lambda pp, vpp, m: None if vpp == 1 else f"{TOY} runs one chunk per rank (got {vpp})",
            order=_order,
            warmup=one.warmup,
            bound=one.bound,
            split_backward=True,
            # each W runs right after its B: one pending at most
            pending_w=lambda pp: 1,
            searched=True,
        )
    )
    yield spec
    del SCHEDULES[TOY]


@pytest.fixture(scope="module")
def pp2():
    small = ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=8"]
    small += ["model.num_query_groups=4", "model.ffn_hidden_size=128", "model.seq_length=64"]
    small += ["model.vocab_size=256", "train.global_batch_size=16"]
    return load_config(["data=synthetic", "parallel.pp=2", *small], world_size=2, check_data=False)


def _refusal(cfg, kind: str, **train) -> str:
    bad = settled(cfg, parallel={"pp_schedule": kind}, train=train)
    with pytest.raises(ConfigError) as e:
        validate(bad, 2, check_data=False)
    return str(e.value)


@pytest.mark.parametrize("train", [{"compile": True}, {"precision": "fp8"}])
def test_a_registered_split_kind_is_refused_by_the_zero_bubble_rule(toy_split, pp2, train):
    toy = _refusal(pp2, TOY, **train)
    assert "splits each backward in two and does not compose with train." in toy
    # the same rule, word for word, as a built-in split kind
    assert toy.replace(TOY, "zb_h1") == _refusal(pp2, "zb_h1", **train)


def test_a_registered_split_kind_keeps_the_split_recompute_rules(toy_split):
    assert splits_backward(TOY)
    with pytest.raises(ValueError, match=f"pp_schedule={TOY} splits each backward.*op_selective"):
        check_runnable(TOY, 2, 1, 4, recompute="op_selective")
    with pytest.raises(ValueError, match=f"pp_schedule={TOY} splits each backward.*MoE"):
        check_runnable(TOY, 2, 1, 4, moe=True, recompute="full")
    check_runnable(TOY, 2, 1, 4)


def test_the_simulator_holds_a_registered_split_kind_to_its_spec(toy_split):
    for sends in SendModel:
        res = simulate(TOY, 3, 1, 6, sends)
        # W ran on every rank, one pending at most (the spec's bound, checked inside simulate)
        assert max(res.peak_pending_w) == 1
        assert all(sum(a.kind == W for _, a in events) == 6 for events in res.timeline)


def test_the_search_tries_a_registered_split_kind_beside_the_real_ones(toy_split, pp2):
    narrow = lambda x: x.pp == 2 and x.zero == 1 and x.recompute == "none"  # noqa: E731
    ests, _, _ = search(pp2, 2, DEVICES["H100"], None, keep=narrow)
    by = {e.layout.schedule: e for e in ests if e.layout.micro_batch == 1}
    assert {"", "zb_h1", TOY} <= set(by), set(by)
    # sized and timed as a split kind: its pending W memory and the bubble of its own order
    assert by[TOY].memory_bytes > 0 and by[TOY].parts["bubble"] != by["zb_h1"].parts["bubble"]
