"""The planner's numbers: its own +key=value settings and every figure of a device profile are checked by
the config's rules (one line, exit 2, naming the setting or field and the value), and a plan with
+device_memory_gb names one device, the one it judged. In-process."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from megaframe.plan import main
from megaframe.planning.devices import DEVICES, Device

PLAN = ["data=synthetic", "model=gpt_tiny", "+world_size=2"]


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megaframe: error: "), err
    return err[0]


def profile(tmp_path, **fields) -> str:
    """The H100 preset written as a profile, some fields replaced (json writes nan as NaN)."""
    raw = {**DEVICES["H100"].to_dict(), **fields}
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(raw))
    return str(path)


@pytest.mark.parametrize(
    "fields,msg",
    [
        # a zero rate was a ZeroDivisionError in the step-time model
        ({"peak_fp32": 0, "peak_bf16": 0}, "peak_bf16=0 must be a finite number > 0"),
        # nan and negative figures planned `nan s, nan tokens/s` with exit 0
        ({"hbm_bw": math.nan}, "hbm_bw=NaN must be a finite number >= 0"),
        ({"intra_bw": -1}, "intra_bw=-1 must be a finite number > 0"),
        ({"memory_gb": "abc"}, 'memory_gb="abc" must be a finite number >= 0, not text'),
        ({"memory_gb": "80"}, 'memory_gb="80" must be'),
        ({"per_node": 2.5}, "per_node=2.5 must be an integer >= 1"),
        ({"efficiency": 1.5}, "efficiency=1.5 must be a finite number > 0 and <= 1"),
        ({"attn_eff": 0}, "attn_eff=0 must be"),
        ({"latency_s": math.inf}, "latency_s=Infinity must be"),
        ({"name": 7}, "name=7 must be text"),
        ({"hops": [[4, 1e-5], [2, 2e-5]]}, "hops=[[4, 1e-05], [2, 2e-05]] must be [[bytes, seconds], ...]"),
        ({"hops": [[4, -1]]}, "hops="),
    ],
)
def test_a_device_profile_with_a_bad_figure_is_one_line_naming_the_field(tmp_path, capsys, fields, msg):
    path = profile(tmp_path, **fields)
    assert main([*PLAN, f"+device_profile={path}"]) == 2
    line = one_error(capsys)
    assert f"+device_profile={path}: " in line and msg in line, line


def test_every_numeric_device_field_has_a_rule_and_the_presets_keep_them():
    from megaframe.planning.devices import PROFILE_RULES, check_profile

    numeric = {f.name for f in dataclasses.fields(Device) if f.type in ("float", "int")}
    assert numeric == set(PROFILE_RULES)
    for name, dev in DEVICES.items():
        check_profile(dev.to_dict(), name)


def test_a_calibrated_cpu_profile_shape_is_accepted():
    """The measured cpu has memory_gb 0 (not known), hbm_bw 0 and a measured hop curve."""
    from megaframe.planning.devices import check_profile

    raw = {**DEVICES["H100"].to_dict(), "memory_gb": 0, "hbm_bw": 0.0, "hops": [[4, 3e-5], [4 << 20, 2e-3]]}
    assert check_profile(raw, "cpu")["hops"] == ((4, 3e-5), (4 << 20, 2e-3))


@pytest.mark.parametrize(
    "setting,msg",
    [
        ("+world_size=0", "+world_size=0 must be an integer >= 1"),
        ("+world_size=2.5", "+world_size=2.5 must be an integer >= 1"),
        ("+link_timeout_s=-1", "+link_timeout_s=-1 must be a finite number > 0 and <= 1e+09"),
        ("+measure=-1", "+measure=-1 must be an integer >= 0"),
        ("+measure_steps=1e9", "+measure_steps=1e9 must be an integer >= 3 and <= 1000"),
        ("+device_memory_gb=abc", "+device_memory_gb=abc must be a finite number > 0"),
    ],
)
def test_planner_settings_are_checked_by_the_rules(capsys, setting, msg):
    assert main([*PLAN, setting]) == 2
    assert msg in one_error(capsys)


def test_a_memory_override_names_the_device_it_judged(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main([*PLAN, "+device_memory_gb=16", f"+plan_json={out}"]) == 0
    text = capsys.readouterr().out
    assert "within 16.00 GiB per device" in text
    # every device line names the 16 GiB device, none the 80 GB one alone
    named = [ln for ln in text.splitlines() if " on H100" in ln]
    assert named and all("H100 SXM5 80GB with 16 GiB (+device_memory_gb)" in ln for ln in named), named
    assert json.loads(out.read_text())["device"] == "H100 SXM5 80GB with 16 GiB (+device_memory_gb)"
