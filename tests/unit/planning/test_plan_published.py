"""The planner against published training runs (planning.published, docs/planning.md#published-runs): the
page's table is what the planner computes now, the step-time ratios stay in their bands, and the compute
model's parts behave as its docstring says (size curve, causal attention, fp8, uneven stages, overlap)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megaframe.config import load_config
from megaframe.plan import main
from megaframe.planning.answer import cli_step_seconds
from megaframe.planning.candidate import Layout, stage_layers
from megaframe.planning.devices import DEVICES, load_profile
from megaframe.planning.error_bands import (
    KINDS,
    RATIO_SPREAD,
    load_rows,
    spread,
    summary,
)
from megaframe.planning.search.rank import MODEL_ERROR, Estimate, break_ties
from megaframe.planning.steptime.compute import block_seconds, gemm_seconds
from megaframe.planning.steptime.timing import step_time

ROOT = Path(__file__).resolve().parents[3]


PLANNED = ROOT / "megaframe" / "planning" / "published_planned.json"


@pytest.fixture(scope="module")
def rows():
    """Every published row as scripts/plan_published.py --write planned it from its command line."""
    return [{**e, "ratio": e["step_time_s"] / e["published_step_s"]} for e in json.loads(PLANNED.read_text())]


def test_the_planned_figures_are_current_for_a_row_of_each_kind(rows):
    """The first row of each kind re-planned now as `plan` times it (planning.answer, from the row's
    command line) gives the stored figure: the stored table is this model's, not an older one's."""
    by_name = {r["name"]: r for r in load_rows()}
    assert set(by_name) == {e["name"] for e in rows}
    for kind in KINDS:
        e = next(e for e in rows if e["kind"] == kind)
        r = by_name[e["name"]]
        cfg = load_config(r["overrides"], world_size=r["world_size"], check_data=False)
        step = sum(cli_step_seconds(cfg, r["world_size"], DEVICES[r["device"]]).values())
        assert step == pytest.approx(e["step_time_s"], rel=1e-6), e["name"]


def test_no_step_part_of_any_row_is_negative(rows):
    """Each part of a planned step is a time the step pays: a negative one is a miscount (a pipeline rank's
    parameters counted below zero gave DeepSeek-V3's pp16 row a dp part of -0.02 s)."""
    for e in rows:
        assert all(v >= 0 for v in e["step_parts_s"].values()), (e["name"], e["step_parts_s"])


def test_the_rows_are_what_a_user_types():
    """Every row is a command line: its overrides compose and validate as `plan` does, with no setting
    outside the config (no per-source switch), on a device `+device=` names."""
    for r in load_rows():
        assert all("=" in o and not o.startswith("+") for o in r["overrides"]), r["name"]
        assert r["device"] in DEVICES and r["published_step_s"] > 0, r["name"]


def test_the_error_summary_per_kind_holds(rows):
    """The table's error summary, not each row: per kind the spread `plan` prints as its band is what the
    rows give now (error_bands.RATIO_SPREAD), the median ratio of all rows within 0.8-1.2 and the median
    absolute error at most 20 %; the search's tie band is sqrt(2) x the dispersion."""
    ratios = [e["ratio"] for e in rows]
    for kind in KINDS:
        mine = [e["ratio"] for e in rows if e["kind"] == kind]
        assert spread(mine, ratios) == pytest.approx(RATIO_SPREAD[kind], abs=0.01), (kind, mine)
    every = summary(ratios)
    assert 0.8 <= every["median"] <= 1.2 and every["mae"] <= 0.2, every
    assert MODEL_ERROR == pytest.approx(2**0.5 * every["dispersion"], abs=0.01)


def test_the_page_states_the_summary_the_rows_give(rows):
    """docs/planning.md's table (scripts/plan_published.py --write) ends with the summary of the rows."""
    every = summary([e["ratio"] for e in rows])
    page = (ROOT / "docs" / "planning.md").read_text()
    assert f"All {len(rows)} runs: ratio median {every['median']:.2f}, median absolute error " in page


def test_a_named_device_alone_decides_fits_and_the_band_is_printed(tmp_path, capsys):
    """+device=NAME without +device_memory_gb judges fits against that device's memory (it was null), and
    the step time comes with its kind's band, in the output and in +plan_json."""
    out = tmp_path / "plan.json"
    tiny = ["data=synthetic", "model=gpt2_tiny", "+world_size=2"]
    assert main([*tiny, "+device=A100", f"+plan_json={out}"]) == 0
    text = capsys.readouterr().out
    d = json.loads(out.read_text())
    assert d["fits"] is True and "fits: every rank within 80.00 GiB" in text
    assert "step time on A100" in text and "tokens/s per device" in text and "pipeline bubble" not in text
    assert d["tokens_per_s_per_device"] > 0 and 0 < d["mfu"] < 1 and d["peak_bytes"] > 0
    lo, hi = d["step_time_band_s"]
    assert lo < d["step_time_s"] < hi and d["layout_kind"] == "dense" and f"band {lo:.3f}-{hi:.3f} s" in text
    assert main([*tiny, f"+plan_json={out}"]) == 0
    assert json.loads(out.read_text())["fits"] is None  # no device named: no memory to judge against


@pytest.mark.parametrize(
    ("world", "ep", "device", "kind"),
    [
        (16, 8, "H100", "moe"),
        (16, 16, "H100", "moe (ep across nodes)"),
        (16, 16, "B200", "moe (ep across nodes)"),
    ],
)
def test_an_expert_group_over_nodes_is_a_kind_of_its_own(world, ep, device, kind, tmp_path):
    """The band of an MoE layout is its kind's: the expert group inside a node (8 ranks of an 8-GPU node)
    or spanning nodes (16), where the all-to-all crosses InfiniBand."""
    out = tmp_path / "plan.json"
    moe = ["data=synthetic", "model=moe_tiny", "model.num_experts=16", f"parallel.ep={ep}"]
    batch = [f"train.global_batch_size={world}", "train.micro_batch_size=1"]
    args = [*moe, *batch, f"+world_size={world}", f"+plan_json={out}"]
    assert main([*args, f"+device={device}"]) == 0
    assert json.loads(out.read_text())["layout_kind"] == kind


def test_gemm_efficiency_rises_with_size_and_fp8_is_faster():
    a100 = DEVICES["A100"]
    effs = [2 * n**3 / gemm_seconds(a100, "bf16", n, n, n) / a100.peak_bf16 for n in (512, 2048, 8192)]
    assert effs[0] < effs[1] < effs[2] <= a100.efficiency
    h100 = DEVICES["H100"]
    assert gemm_seconds(h100, "fp8", 8192, 8192, 8192) < 0.6 * gemm_seconds(h100, "bf16", 8192, 8192, 8192)


def test_fp8_keeps_attention_bf16():
    cfg = load_config(["model=llama3_8b"], world_size=1, check_data=False)
    h100 = DEVICES["H100"]
    fused = block_seconds(cfg, h100, 1, 1, 1, False)
    fp8 = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision="fp8"))
    b8 = block_seconds(fp8, h100, 1, 1, 1, False)
    assert b8["gemm"] < fused["gemm"] and b8["attention"] == fused["attention"]


def test_uneven_stages_time_the_largest_and_overlap_hides_tp():
    cfg = load_config(["model=llama3_8b"], world_size=1, check_data=False)
    even = Layout(8, 4, 1, 2, 1, 1, 1, "none")
    uneven = dataclasses.replace(even, pp_layout=(8, 8, 7, 9))  # the last stage also holds the head
    assert stage_layers(32, uneven) == [8, 8, 7, 9]
    h100 = DEVICES["H100"]
    assert step_time(cfg, uneven, h100, 64)["compute"] > step_time(cfg, even, h100, 64)["compute"]
    over = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp_comm_overlap=True))
    assert step_time(over, even, h100, 64)["tp"] < step_time(cfg, even, h100, 64)["tp"]


def test_ties_ordered_by_memory_then_simplicity():
    gib = 2**30
    fast = Estimate(Layout(2, 2, 1, 2, 1, 1, 1, "none"), 70 * gib, {"compute": 1.0})
    lean = Estimate(
        Layout(1, 1, 1, 8, 1, 1, 1, "none"), 40 * gib + 2**23, {"compute": 1.05}
    )  # 8 MiB more: same
    complex_ = Estimate(Layout(2, 1, 1, 4, 1, 2, 1, "full"), 40 * gib, {"compute": 1.04})
    slow = Estimate(Layout(1, 1, 1, 8, 1, 1, 1, "none"), 10 * gib, {"compute": 2.0})
    got = break_ties([fast, complex_, lean, slow], 0.1)
    assert [e.memory_bytes // gib for e in got] == [40, 40, 70, 10]
    assert break_ties([fast, complex_, lean, slow], 0.1)[0] is lean


def test_calibrate_writes_a_profile_the_planner_uses(tmp_path, capsys):
    prof = tmp_path / "dev.json"
    assert main(["calibrate", "--quick", f"--out={prof}"]) == 0
    dev = load_profile(str(prof))
    assert dev.peak_bf16 > 0 and 0 < dev.efficiency <= 1
    assert main(["data=synthetic", "model=gpt2_tiny", "+world_size=1", f"+device_profile={prof}"]) == 0
    assert "step time on cpu" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["data=synthetic", "model=gpt2_tiny", "+world_size=1", f"+device_profile={bad}"]) == 2


def test_fp8_layouts_are_sized_as_bf16_and_timed_faster():
    """fp8 keeps bf16 params and activations (2 bytes, ZeRO >= 1) and runs its block GEMMs faster."""
    from megaframe.planning.memory.dims import phase_memory
    from megaframe.planning.search.candidates import _state_choices

    base = ["model=llama3_8b", "model.num_layers=2"]
    b16 = load_config([*base, "train.precision=bf16"], world_size=1, check_data=False)
    f8 = dataclasses.replace(b16, train=dataclasses.replace(b16.train, precision="fp8"))
    assert {z for z, _, _ in _state_choices(f8, 1, 1, 8, 1, 8)} == {1, 2, 3}
    lay = Layout(1, 1, 1, 8, 1, 1, 1, "none")
    assert phase_memory(f8, lay)["startup"] == phase_memory(b16, lay)["startup"]
    h100 = DEVICES["H100"]
    assert step_time(f8, lay, h100, 8)["compute"] < step_time(b16, lay, h100, 8)["compute"]


def test_full_recompute_holds_the_recomputed_blocks_working_set():
    """Under full recompute the step also holds one block's whole saved set while it is re-run: the block
    recompute=none keeps (search.working_set_bytes), in both the exact planner and the search."""
    from megaframe.planning.memory.block_memory import working_set_bytes
    from megaframe.planning.memory.rank_plan import plan_layout

    over = [
        "data=synthetic",
        "model.num_layers=4",
        "model.hidden_size=256",
        "model.num_attention_heads=8",
        "model.ffn_hidden_size=1024",
        "model.seq_length=512",
        "model.vocab_size=256",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
    ]
    full = load_config([*over, "train.recompute=full"], world_size=1, check_data=False)
    none = load_config(over, world_size=1, check_data=False)
    ws = working_set_bytes(full, 1, 1, "full", 2)
    per_block = (
        plan_layout(none, 1).ranks[0].activation_bytes
        - plan_layout(load_config([*over, "model.num_layers=3"], world_size=1, check_data=False), 1)
        .ranks[0]
        .activation_bytes
    )
    assert ws == per_block > 0 and working_set_bytes(none, 1, 1, "none", 2) == 0
    r = plan_layout(full, 1).ranks[0]
    state = r.params_bytes + r.grads_bytes + r.optim_bytes
    assert r.phases["step"] >= state + r.activation_bytes + ws


def test_search_tries_vpp_8_and_short_end_stages():
    """vpp up to 8 where the layers allow it, and (past two stages) the first and last stage one block short
    as a parallel.pp_layout that validate() accepts (Llama 3's 126 layers on pp16 is this shape)."""
    from megaframe.planning.search.candidates import candidates

    tiny = [
        "data=synthetic",
        "model.hidden_size=64",
        "model.num_attention_heads=4",
        "model.num_query_groups=2",
        "model.ffn_hidden_size=128",
        "model.seq_length=64",
        "model.vocab_size=256",
        "train.global_batch_size=16",
    ]
    c16 = load_config([*tiny, "model.num_layers=16"], world_size=1, check_data=False)
    assert any(x.pp == 2 and x.vpp == 8 for x in candidates(c16, 2, 8, keep=lambda x: x.zero == 1))
    c14 = load_config([*tiny, "model.num_layers=14"], world_size=1, check_data=False)
    short = [x for x in candidates(c14, 4, 8, keep=lambda x: x.zero == 1 and x.pp == 4)]
    assert short and all(x.pp_layout == (3, 4, 4, 3) for x in short)  # 14 does not split evenly on 4
    assert "parallel.pp_layout=[3,4,4,3]" in short[0].overrides()
