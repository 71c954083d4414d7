"""The layout search: candidates are exactly the layouts validate() accepts, the search's memory agrees
with the exact per-rank planner, the step-time model's parts follow its stated rules, and the command
prints a ranked top list with reasons."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megaframe.config import load_config
from megaframe.plan import main
from megaframe.planning.candidate import Layout, layout_config
from megaframe.planning.devices import DEVICES, get_device
from megaframe.planning.memory import dims
from megaframe.planning.memory.dims import memory, phase_memory
from megaframe.planning.memory.rank_plan import plan_layout
from megaframe.planning.search.candidates import Ticker, candidates
from megaframe.planning.search.rank import MODEL_ERROR, Estimate, search, ties
from megaframe.planning.steptime.compute import gemm_dims as _gemm_dims
from megaframe.planning.steptime.compute import gemm_efficiency
from megaframe.planning.steptime.timing import step_time

SMALL = [
    "data=synthetic",
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=128",
    "model.seq_length=64",
    "model.vocab_size=256",
    "train.global_batch_size=16",
]


@pytest.fixture(scope="module")
def cfg():
    return load_config(SMALL, world_size=1, check_data=False)


def test_candidates_are_valid_and_cover_the_axes(cfg):
    lays = candidates(cfg, 8, 8)
    assert {(x.tp, x.pp) for x in lays} >= {(1, 1), (2, 2), (4, 2), (2, 4), (1, 4)}
    assert not any(x.tp == 8 for x in lays)  # 4 kv heads do not split 8 ways
    assert all(x.tp * x.cp * x.pp * x.dp == 8 for x in lays)
    assert any(x.vpp == 2 for x in lays) and {x.recompute for x in lays} == {
        "none",
        "selective",
        "full",
        "op_selective",
    }


def _search_read(cfg, lay) -> int:
    from megaframe.planning.memory.dims import _shape

    return max(_shape(cfg, lay, first, not first, 4).read_bytes for first in (True, False))


@pytest.mark.parametrize(
    "lay",
    [
        Layout(1, 1, 1, 4, 1, 1, 2, "none"),
        Layout(2, 2, 1, 1, 1, 1, 1, "none"),
        Layout(2, 2, 2, 1, 1, 0, 2, "full"),
        Layout(1, 4, 1, 1, 1, 1, 1, "selective"),
        Layout(1, 1, 1, 4, 1, 2, 2, "none"),
        Layout(1, 1, 1, 4, 1, 3, 1, "none"),
        Layout(1, 1, 1, 4, 1, 2, 2, "none", shard=2),
        Layout(1, 2, 1, 2, 1, 3, 1, "full"),
    ],
)
def test_search_memory_matches_the_exact_planner(cfg, lay):
    """Every phase of the search's largest rank within 5 % of the exact planner's (a built meta model)."""
    exact = plan_layout(layout_config(cfg, lay), 4, None)
    worst = max(exact.ranks, key=lambda r: r.peak_bytes)
    got = phase_memory(cfg, lay)
    assert set(got) == {"startup", "step", "save", "load"}
    # The search knows no param order inside a ZeRO unit, so its read window (start-up's draw and the load's
    # staging) is the unit's largest matrix or its share, where the exact planner cuts params at share edges
    # (optim/sizing.largest_segment): it may read high by up to one such window (5 bytes an element: the fp32
    # draw and a cast), never low. Since ZeRO's state is lazy that window is a visible part of start-up.
    window = 5 * _search_read(cfg, lay) // 4
    for k, want in worst.phases.items():
        slack = window if k in ("startup", "load") else 0
        assert -0.05 * want < got[k] - want < 0.05 * want + slack, (k, got, worst.phases)
    assert memory(cfg, lay) == max(got.values())


MOE = ["data=synthetic", "model=qwen3_moe_tiny", "train.global_batch_size=8"]


@pytest.mark.parametrize(
    "preset,lay",
    [
        ("qwen3_moe_tiny", Layout(2, 1, 1, 2, 2, 1, 1, "none")),
        ("qwen3_moe_tiny", Layout(2, 1, 1, 2, 2, 3, 1, "none")),
        ("qwen3_moe_tiny", Layout(2, 1, 1, 2, 4, 2, 1, "none")),
        ("qwen3_moe_tiny", Layout(1, 1, 1, 4, 2, 1, 1, "none")),
        ("deepseek_v3_tiny", Layout(1, 2, 1, 2, 2, 1, 1, "none")),
        ("deepseek_v3_tiny", Layout(1, 2, 1, 2, 2, 1, 1, "none", pp_layout=(3, 1))),
    ],
)
def test_search_memory_of_moe_layouts_matches_the_exact_planner(preset, lay):
    """Expert state is sharded over the experts' data parallelism, tp·cp·dp / ep as the trainer folds it
    (parallel/rank_grid.py), not cp·dp / ep: under tp2 ep2 the search counted the experts' optimizer state
    twice over (zero=1 step +8 %, zero=3 +20 %). A rank's parameters are its own blocks' (DeepSeek's dense
    first blocks and MTP depth): counted as uniform MoE blocks the step was 2.3-2.6 % off."""
    moe = load_config([*MOE, f"model={preset}"], world_size=1, check_data=False)
    exact = plan_layout(layout_config(moe, lay), 4, None)
    worst = max(exact.ranks, key=lambda r: r.peak_bytes)
    assert dims._state(moe, lay, True, True, 2)[2] == worst.optim_bytes
    got = phase_memory(moe, lay)
    assert abs(got["step"] - worst.phases["step"]) < 0.01 * worst.phases["step"], (got, worst.phases)


def test_candidates_fold_ep_over_tp_as_the_trainer_does():
    """ep takes its ranks from tp·cp·dp (Megatron's MoE parallel folding), so a layout whose ep exceeds
    cp·dp (Megatron-Bridge's Qwen3-235B: ep32 over tp2 x dp16) is proposed; before, ep came from cp·dp."""
    moe = load_config(MOE, world_size=1, check_data=False)
    lays = candidates(moe, 8, 8, keep=lambda x: x.pp == 1 and x.zero == 1 and x.micro_batch == 1)
    assert any(x.ep > x.cp * x.dp for x in lays)
    assert {(x.tp, x.dp, x.ep) for x in lays if x.cp == 1} >= {(2, 4, 8), (2, 4, 2), (1, 8, 8)}


def test_an_expert_model_is_searched_under_the_overlapped_kinds_too(cfg):
    """Their pairs hide the experts' all-to-alls: tried for a model with experts (1f1b_overlap without a
    pipeline, interleaved_overlap over chunks), validated like any kind (recompute refused there), and never
    for a dense model, where they only hold one chunk more."""
    moe = load_config(MOE, world_size=1, check_data=False)
    lays = candidates(moe, 8, 8, keep=lambda x: x.zero == 1 and x.micro_batch == 1)
    kinds = {(x.schedule, x.pp > 1, x.vpp > 1) for x in lays if "overlap" in x.schedule}
    assert kinds == {("1f1b_overlap", False, False), ("interleaved_overlap", True, True)}, kinds
    assert all(x.recompute == "none" for x in lays if "overlap" in x.schedule)
    assert not any("overlap" in x.schedule for x in candidates(cfg, 8, 8, keep=lambda x: x.zero == 1))
    # the overlap is planned: its pairs (7 of 8 micro-batches) pay only the all-to-all past the compute
    one = next(x for x in lays if x.schedule == "1f1b_overlap" and x.ep == 8 and x.tp == 1 and x.cp == 1)
    plain, h100 = dataclasses.replace(one, schedule=""), get_device("H100")
    moe = load_config([*MOE, "train.global_batch_size=64"], world_size=1, check_data=False)
    over, base = step_time(moe, one, h100, 8), step_time(moe, plain, h100, 8)
    assert base["ep"] > 0 and over["ep"] < base["ep"] and over["compute"] == base["compute"]


def test_candidates_search_every_zero_stage_hsdp_and_grad_dtype():
    bf16 = load_config([*SMALL, "train.precision=bf16"], world_size=1, check_data=False)
    lays = candidates(bf16, 16, 8)
    assert {x.zero for x in lays} == {1, 2, 3}  # bf16 params need ZeRO's fp32 master
    assert {x.grad_dtype for x in lays} == {"fp32", "bf16"}
    # HSDP: shard groups of whole nodes, smaller than cp·dp
    hsdp = {(x.tp, x.cp, x.dp, x.shard) for x in lays if x.shard}
    assert (1, 1, 16, 8) in hsdp and all((t * c * s) % 8 == 0 and s < c * d for t, c, d, s in hsdp)
    fp32 = candidates(load_config(SMALL, world_size=1, check_data=False), 16, 8)
    assert {x.zero for x in fp32} == {0, 1, 2, 3} and {x.grad_dtype for x in fp32} == {"fp32"}
    assert not any(x.zero >= 2 for x in fp32 if x.dp * x.cp == 1)  # nothing to shard over one rank


def test_bf16_grads_halve_grad_memory_and_reduce_traffic():
    c = load_config(
        [
            *SMALL,
            "train.precision=bf16",
            "model.hidden_size=1024",
            "model.ffn_hidden_size=4096",
            "model.num_attention_heads=16",
            "model.num_query_groups=16",
        ],
        world_size=1,
        check_data=False,
    )
    fp32, bf16 = Layout(1, 1, 1, 16, 1, 2, 1, "none"), Layout(1, 1, 1, 16, 1, 2, 1, "none", grad_dtype="bf16")
    g32 = dims._state(c, fp32, True, True, 2)[1]
    assert dims._state(c, bf16, True, True, 2)[1] * 2 == g32
    slow = dataclasses.replace(DEVICES["H100"], inter_bw=1e9)  # a slow link: the reduce-scatter is exposed
    t32, t16 = step_time(c, fp32, slow, 16)["dp"], step_time(c, bf16, slow, 16)["dp"]
    assert t16 < t32


def test_dp_traffic_is_charged_as_overlapped():
    """ZeRO-2's per-micro-batch reduce-scatter hides behind backward; ZeRO-0's after-backward all-reduce
    does not: with links fast enough to hide it, ZeRO-2 pays only its last bucket."""
    c = load_config(
        [
            *SMALL,
            "model.hidden_size=1024",
            "model.ffn_hidden_size=4096",
            "model.num_attention_heads=16",
            "model.num_query_groups=16",
            "model.seq_length=2048",
        ],
        world_size=1,
        check_data=False,
    )
    h100 = DEVICES["H100"]
    z0 = step_time(c, Layout(1, 1, 1, 8, 1, 0, 1, "none"), h100, 8)
    z2 = step_time(c, Layout(1, 1, 1, 8, 1, 2, 1, "none"), h100, 8)
    assert z2["dp"] < 0.5 * z0["dp"], (z0, z2)
    slow = dataclasses.replace(h100, intra_bw=1e8)  # a link too slow to hide anything: exposed again
    assert step_time(c, Layout(1, 1, 1, 8, 1, 2, 1, "none"), slow, 8)["dp"] > z2["compute"]


def test_gemm_efficiency_depends_on_the_shape():
    """Thin GEMMs (large tp, few tokens) are memory- or launch-bound: below the large-GEMM efficiency;
    without an HBM figure (cpu) it is the device's constant."""
    c = load_config(["model=llama3_8b"], world_size=1, check_data=False).model
    h100 = DEVICES["H100"]
    effs = [
        gemm_efficiency(h100, "bf16", tokens, _gemm_dims(c, tp))
        for tp, tokens in ((1, 8192), (8, 8192), (8, 512))
    ]
    assert h100.efficiency >= effs[0] > effs[1] > effs[2] > 0.3
    assert gemm_efficiency(
        dataclasses.replace(h100, hbm_bw=0.0), "bf16", 512, _gemm_dims(c, 8)
    ) == pytest.approx(h100.efficiency)


def test_ties_within_the_measured_error():
    lay = Layout(1, 1, 1, 4, 1, 1, 2, "none")
    ests = [Estimate(lay, 1, {"compute": t}) for t in (1.0, 1.05, 1.11, 1.2)]
    assert ties(ests, 0.113) == 3 and ties(ests[:1]) == 1 and ties([]) == 0


def test_step_time_parts_follow_the_model(cfg):
    h100 = DEVICES["H100"]
    base = step_time(cfg, Layout(1, 1, 1, 8, 1, 1, 2, "none"), h100, 8)
    assert base["tp"] == base["pp"] == base["bubble"] == 0 and base["dp"] > 0
    full = step_time(cfg, Layout(1, 1, 1, 8, 1, 1, 2, "full"), h100, 8)
    assert full["compute"] > base["compute"]
    pp = step_time(cfg, Layout(1, 2, 1, 4, 1, 1, 2, "none"), h100, 8)  # 2 micro-batches: bubble 1/3
    inner = pp["compute"] + pp["launch"]  # the bubble stretches the micro-batches' work, launches included
    assert pp["bubble"] == pytest.approx(inner / (1 - 1 / 3) - inner)
    tp = step_time(cfg, Layout(8, 1, 1, 1, 1, 1, 2, "none"), h100, 8)
    assert tp["tp"] > 0 and tp["dp"] == 0


def test_search_command_prints_a_ranked_top(capsys, tmp_path):
    out_json = tmp_path / "plan.json"
    assert (
        main(
            [
                *SMALL,
                "+world_size=8",
                "+device_memory_gb=80",
                "+search=true",
                "+device=A100",
                "+top=3",
                f"+plan_json={out_json}",
            ]
        )
        == 0
    )
    cap = capsys.readouterr()
    out = cap.out
    assert "valid layouts" in out and ("#2 loses to #1 by +" in out or "#2 ties with #1" in out)
    assert "run #1 with: parallel.tp=" in out
    assert "startup/step/save/load" in out and f"are ties: within {MODEL_ERROR:.0%} of the fastest" in out
    ranked = [e["step_s"] for e in json.loads(out_json.read_text())["ranked"]]
    k = json.loads(out_json.read_text())["ties_with_first"]
    assert all(t <= min(ranked) * (1 + MODEL_ERROR) for t in ranked[:k])  # the tie group comes first
    assert "search: " in cap.err and "layouts in" in cap.err  # progress, on stderr
    got = json.loads(out_json.read_text())  # +plan_json is written by the search too
    assert got["ranked"] and got["ranked"][0]["layout"]["overrides"] == out.split("run #1 with: ")[1].split()
    assert (
        set(got["ranked"][0]["phases"]) == {"startup", "step", "save", "load"} and got["ties_with_first"] >= 1
    )
    assert main([*SMALL, "+world_size=8", "+search=true", "+device=Z80"]) == 2


def test_a_tiny_memory_drops_every_layout(cfg):
    ests, n, dropped = search(cfg, 4, DEVICES["H100"], 1e3)
    assert not ests and n == dropped > 0
    assert (
        get_device("h200").memory_gb == 141
        and dataclasses.replace(get_device("B200"), efficiency=0.4).efficiency == 0.4
    )


def test_a_dense_model_pays_no_expert_collective(cfg):
    """Only latency (links infinitely fast, compute free: nothing overlaps): ZeRO-1's reduce-scatter and
    all-gather, 7 ring steps each over dp=8 and one bucket, plus the unhidden tail of as much again; a dense
    model's absent expert collective adds nothing (it used to add its ring's latency)."""
    dev = dataclasses.replace(
        DEVICES["H100"], latency_s=1.0, intra_bw=1e30, inter_bw=1e30, hbm_bw=0.0, efficiency=1e12
    )
    lay = Layout(1, 1, 1, 8, 1, 1, 1, "none")  # 16 samples / (mb 1 x dp 8): 2 micro-batches, one bucket
    assert step_time(cfg, lay, dev, 8)["dp"] == pytest.approx(14 + 14 / 2, rel=1e-6)


def test_zero3_pays_latency_per_block_not_per_bucket(cfg):
    """ZeRO-3's collectives go block by block (4 blocks + the params outside them here), whatever
    optim.bucket_size_mb: a tiny bucket size changes nothing for zero=3 and multiplies zero=1's latency."""
    dev = dataclasses.replace(
        DEVICES["H100"], latency_s=1.0, intra_bw=1e30, inter_bw=1e30, hbm_bw=0.0, efficiency=1e12
    )
    tiny = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, bucket_size_mb=0.001))
    z3 = Layout(1, 1, 1, 8, 1, 3, 1, "none")
    assert step_time(tiny, z3, dev, 8)["dp"] == step_time(cfg, z3, dev, 8)["dp"]
    z1 = Layout(1, 1, 1, 8, 1, 1, 1, "none")
    assert step_time(tiny, z1, dev, 8)["dp"] > 10 * step_time(cfg, z1, dev, 8)["dp"]


def test_search_ranks_zero_bubble_schedules_and_prefers_zbv_at_pp8_small_m(capsys):
    """pp8 with 8 micro-batches: the bubble is most of the cost, and the model (schedule simulated with F, B,
    W from the backward's split) puts zbv ahead of 1f1b, zb_h1 between; the memory model counts the
    pending W (zb_h1 holds more than 1f1b)."""
    from megaframe.planning.steptime.timing import _bubble, split_costs

    c = load_config(
        [*SMALL, "model.num_layers=16", "train.global_batch_size=8"], world_size=1, check_data=False
    )
    lays = candidates(c, 8, 8)
    assert {x.schedule for x in lays if x.pp == 8} == {"", "zb_h1", "zbv"}
    assert all(x.vpp == {"zb_h1": 1, "zbv": 2}[x.schedule] for x in lays if x.schedule)
    h100, base = DEVICES["H100"], Layout(1, 8, 1, 1, 1, 1, 1, "none")
    times = {
        s: step_time(c, dataclasses.replace(base, vpp=2 if s == "zbv" else 1, schedule=s), h100, 8)
        for s in ("1f1b", "zb_h1", "zbv")
    }
    total = {s: sum(t.values()) for s, t in times.items()}
    assert total["zbv"] < total["zb_h1"] < total["1f1b"], total
    costs = split_costs(c)
    assert costs[0] == 1.0 and costs[2] < costs[1] < 1.5 * costs[2] + 1  # B = W + attention backward
    bubbles = {s: _bubble(s, 8, 2 if s == "zbv" else 1, 8, costs if s != "1f1b" else None) for s in total}
    with capsys.disabled():
        print(f"\npp8 m8 F:B:W={costs}: idle/makespan {bubbles}; step s {total}")
    assert bubbles["zbv"] < bubbles["zb_h1"] < bubbles["1f1b"]
    mem = {s: memory(c, dataclasses.replace(base, vpp=2 if s == "zbv" else 1, schedule=s)) for s in total}
    assert mem["zb_h1"] >= mem["1f1b"]  # pending W: the price of the bubble


def test_the_search_counts_its_validation_and_sizing(cfg, monkeypatch):
    """Both passes report `i/total` (every EVERY_S seconds; at 0, every layout): the enumeration and
    validation, minutes for llama3_8b on 64 ranks, printed nothing before."""
    monkeypatch.setattr(Ticker, "EVERY_S", 0.0)
    heard: list[str] = []
    narrow = lambda x: x.zero == 1 and x.recompute == "none" and x.micro_batch == 1  # noqa: E731
    search(cfg, 4, get_device("A100"), None, progress=heard.append, keep=narrow)
    validated = [t for t in heard if "layouts validated" in t]
    sized = [t for t in heard if "layouts sized and timed" in t]
    total = int(validated[0].split("/")[1].split()[0])
    assert len(validated) == total and validated[-1].startswith(f"search: {total - 1}/{total} ")
    assert sized and all("fit" in t for t in sized)


@pytest.mark.parametrize("model", ["gpt_tiny", "moe_tiny"])
@pytest.mark.parametrize("rule", ["adamw", "muon"])
def test_the_search_sizes_each_rules_state_at_zero0_as_the_built_model_holds(rule, model):
    """zero=0: the rule's bytes per element of each kind of parameter (Muon: momentum on the hidden
    matrices, AdamW's moments on the rest), as rank_state.state_bytes counts a built model's Placements."""
    over = [f"model={model}", f"optim.name={rule}", "optim.zero=0", "optim.state_dtype=bf16"]
    cfg = load_config(over, world_size=1, check_data=False)
    lay = Layout(1, 1, 1, 1, 1, 0, 1, "none")
    assert dims._state(cfg, lay, True, True, 4)[2] == plan_layout(cfg, 1).ranks[0].optim_bytes
