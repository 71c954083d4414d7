"""The planner with context parallelism: the meta forward runs on the rank's S/cp tokens (activations
fall ~1/c, the gathered K/V on top for allgather, and its shared causal bias only with attention
dropout, the one case that builds it), a row covers every cp·dp
rank of its coordinate, comm_bytes/cp per step is context.cp_bytes_per_layer x layers x micro-batches,
the command prints it, and the search enumerates cp with its exchange in the step time."""

from __future__ import annotations

import dataclasses

import pytest

from megaframe.config import load_config
from megaframe.parallel.context import cp_bytes_per_layer
from megaframe.plan import main
from megaframe.planning.candidate import Layout, layout_config
from megaframe.planning.devices import DEVICES
from megaframe.planning.memory.dims import memory, phase_memory
from megaframe.planning.memory.rank_plan import plan_layout
from megaframe.planning.search.candidates import candidates
from megaframe.planning.steptime.compute import block_seconds
from megaframe.planning.steptime.timing import step_time
from megaframe.training.metrics import flops_per_token
from tests.unit.planning.test_plan_search import SMALL

LONG = [
    "data=synthetic",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=256",
    "model.seq_length=1024",
    "model.vocab_size=256",
    "train.micro_batch_size=1",
    "train.global_batch_size=4",
]


def plan(world: int, *extra: str):
    cfg = load_config(LONG + list(extra), world_size=world, check_data=False)
    return cfg, plan_layout(cfg, world)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("kind", ["allgather", "ring"])
@pytest.mark.parametrize("cp", [2, 4])
def test_activations_fall_about_1_over_c(kind, cp, dropout):
    _, one = plan(1, f"model.dropout={dropout}")
    cfg, many = plan(cp, f"parallel.cp={cp}", f"parallel.cp_comm={kind}", f"model.dropout={dropout}")
    base, got = one.ranks[0].chunk_activation_bytes[0], many.ranks[0].chunk_activation_bytes[0]
    # about 1/c: allgather also saves the whole group's K/V, the ring its fp32 output and log-sum-exp
    assert 0.95 * base / cp < got < 1.25 * base / cp, (got, base)
    bias = many.ranks[0].activation_bytes - got  # one micro-batch in flight: the rest is the shared bias
    # without dropout the allgather path attends per query chunk: no [S/c, S] mask (cp_attention.py)
    assert bias == (1024 * 1024 // cp * 4 if kind == "allgather" and dropout > 0 else 0)
    assert (
        many.layout["cp"] == cp and many.layout["dp"] == 1 and sorted(many.ranks[0].ranks) == list(range(cp))
    )


@pytest.mark.parametrize(
    "kind,recompute", [("allgather", "none"), ("ring", "none"), ("ring", "selective"), ("allgather", "full")]
)
def test_cp_bytes_per_step_follow_the_theory(kind, recompute):
    cfg, p = plan(4, "parallel.cp=2", f"parallel.cp_comm={kind}", f"train.recompute={recompute}")
    micro = 4 // (1 * 2)  # global batch 4, micro-batch 1, dp = 4 / cp = 2
    per = cp_bytes_per_layer(1024, 2, 1, 2, 16, 4, kind == "ring", recompute)
    assert p.ranks[0].cp_comm_bytes == 2 * micro * per > 0
    assert sorted(p.ranks[0].ranks) == [0, 1, 2, 3]  # cp·dp ranks of the one coordinate
    _, none = plan(1)
    assert none.ranks[0].cp_comm_bytes == 0


def test_theory_counts():
    block = 512 * 1 * 2 * 16  # S/c x B x K x E elements
    assert (
        cp_bytes_per_layer(1024, 2, 1, 2, 16, 2, False) == 4 * block * 2
    )  # bf16 K, V gathered, grads scattered
    assert (
        cp_bytes_per_layer(1024, 2, 1, 2, 16, 2, True) == 4 * block * 2 + 4 * block * 4
    )  # + 2 fp32 dK/dV moves
    assert cp_bytes_per_layer(1024, 1, 1, 2, 16, 2, True) == 0


def test_plan_command_prints_cp(capsys):
    assert main(LONG + ["parallel.cp=2", "parallel.cp_comm=ring", "+world_size=4"]) == 0
    out = capsys.readouterr().out
    assert "cp=2 (ring)" in out and "cp bytes/step" in out
    row = [line for line in out.splitlines() if line.startswith("0 ")][0]
    assert "0-3" in row and row.split()[-2:] != ["-", "-"]


def test_search_enumerates_cp_and_prices_the_exchange():
    cfg = load_config(SMALL, world_size=1, check_data=False)
    lays = candidates(cfg, 8, 8)
    assert {x.cp for x in lays} >= {1, 2, 4} and all(x.tp * x.cp * x.pp * x.dp == 8 for x in lays)
    h100 = DEVICES["H100"]
    base = step_time(cfg, Layout(1, 1, 1, 8, 1, 1, 1, "none"), h100, 8)
    cp = step_time(cfg, Layout(1, 1, 1, 4, 1, 1, 1, "none", cp=2), h100, 8)
    # the same FLOPs; S/cp tokens per GEMM are no faster (planning.steptime.timing.gemm_efficiency)
    assert base["cp"] == 0 and cp["cp"] > 0 and base["compute"] <= cp["compute"] <= 2.5 * base["compute"]
    ring_cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cp_comm="ring"))
    ring = step_time(ring_cfg, Layout(1, 1, 1, 4, 1, 1, 1, "none", cp=2), h100, 8)
    # the ring sends more (the fp32 dK/dV travel too) but hides it behind the block attention, up to the
    # attention core's time: never less than its hops' latency, never more than the unhidden transfer
    hops = 4 * 4 * (3 * (2 - 1) + 1)  # 4 layers x 4 micro-batches x (3(c-1) + 1) ring steps
    sent = 4 * 4 * cp_bytes_per_layer(64, 2, 1, 4, 8, 4, True)
    bw = h100.intra_bw * h100.link_eff
    assert hops * h100.latency_s <= ring["cp"] < sent / bw + hops * h100.latency_s


@pytest.mark.parametrize(
    "lay",
    [
        Layout(1, 1, 1, 2, 1, 1, 1, "none", cp=2),
        Layout(2, 1, 1, 1, 1, 0, 2, "full", cp=2),
        Layout(1, 2, 1, 1, 1, 1, 1, "selective", cp=2),
    ],
)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_search_memory_matches_the_exact_planner_under_cp(lay, dropout):
    cfg = load_config(SMALL + [f"model.dropout={dropout}"], world_size=1, check_data=False)
    exact = plan_layout(layout_config(cfg, lay), 4, None)
    worst = max(exact.ranks, key=lambda r: r.peak_bytes)
    got = phase_memory(cfg, lay)
    for k, want in worst.phases.items():  # every phase of the largest rank
        assert abs(got[k] - want) / want < 0.05, (k, got, worst.phases)
    assert memory(cfg, lay) == max(got.values())


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_cp_rank_times_its_share_of_the_attention_once(cp, dropout):
    """parallel/context.py's balanced cut (rank r keeps chunks r and 2c-1-r) gives each rank 1/cp of the
    causal square: the rank's S/cp tokens carry the whole split. With attention dropout both cp paths
    compute the masked [S/cp, S] square in full (model/attention.py): twice the causal share."""
    cfg = load_config(LONG + [f"model.dropout={dropout}"], world_size=1, check_data=False)
    h100 = DEVICES["H100"]
    one = block_seconds(cfg, h100, 1, 1, 1, False)["attention"]
    share = block_seconds(cfg, h100, 1, cp, 1, False)["attention"]
    assert share == pytest.approx(one / cp * (2 if dropout else 1), rel=1e-9)


def test_no_cp_candidate_beats_the_device():
    """Every layout of a long-context search plans at most the device's peak in model FLOPs (MFU <= 1),
    and the FLOPs the kernels really run (the causal half of the attention core, no re-run forward) at
    most at the device's best GEMM rate: a rate above it is a step the planner times too fast."""
    # attention-bound: 64k tokens against 2k hidden, compiled (no eager elementwise traffic to hide it)
    wide = ["model.hidden_size=2048", "model.num_attention_heads=16", "model.ffn_hidden_size=4096"]
    long = ["model.seq_length=65536", "train.global_batch_size=8", "train.compile=true"]
    cfg = load_config(LONG + wide + long, world_size=1, check_data=False)
    h100 = DEVICES["H100"]
    lays = candidates(cfg, 8, 8, keep=lambda x: x.recompute == "none")
    assert {x.cp for x in lays} >= {2, 4, 8}
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    for lay in lays:
        rate = tokens / sum(step_time(cfg, lay, h100, 8).values()) / 8 / h100.peak_bf16
        assert rate * flops_per_token(cfg.model) <= 1.0, lay
        assert rate * flops_per_token(cfg.model, causal=True) <= h100.efficiency, lay
