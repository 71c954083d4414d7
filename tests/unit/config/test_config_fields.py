"""Every numeric config field is validated (range, finiteness, type) from one table, FIELD_RULES:
a bad value of any of them is refused by load_config (exit 2 in train.py, before any process group)
with one line naming the field."""

import dataclasses
import sys
import typing

import pytest

from megaframe.config import Config, ConfigError, default_run_name, load_config
from megaframe.config.checks import FIELD_RULES, Rule
from tests.e2e.helpers import run

ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]


def numeric_fields(cls=Config, prefix="") -> list[str]:
    """Dotted names of every int/float (or Optional of one) field of the schema."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints.get(f.name, f.type)
        args = [a for a in typing.get_args(t) if a is not type(None)]
        base = args[0] if typing.get_origin(t) is typing.Union and len(args) == 1 else t
        name = f.name
        if typing.get_origin(base) is list:  # the numbers inside a list: `[]` for every element
            base, name = typing.get_args(base)[0], f"{f.name}[]"
        if dataclasses.is_dataclass(base):
            out += numeric_fields(base, f"{prefix}{name}.")
        elif base in (int, float):
            out.append(prefix + name)
    return out


def bad_values(rule: Rule) -> list[str]:
    vals = []
    if rule.lo is not None:
        vals.append(str(rule.lo if rule.lo_open else (rule.lo - 1 if rule.integer else rule.lo - 0.5)))
    if rule.hi is not None:
        vals.append(
            str(
                int(rule.hi)
                if rule.integer and rule.hi_open
                else (rule.hi + 1 if rule.integer else rule.hi + (0 if rule.hi_open else 0.5))
            )
        )
    if not rule.integer:
        vals += ["inf", "nan", "-inf"]
    return vals


def test_every_numeric_field_has_a_rule():
    fields = set(numeric_fields())
    assert fields - FIELD_RULES.keys() == set(), "add a rule to FIELD_RULES in megaframe/config/checks.py"
    assert FIELD_RULES.keys() - fields == set(), "FIELD_RULES names a field the schema does not have"


CASES = [(key, v) for key, rule in FIELD_RULES.items() for v in bad_values(rule) if "[]" not in key]


@pytest.fixture(scope="module")
def base_cfg():
    return load_config(["data=synthetic"], world_size=1)


@pytest.mark.parametrize("key,value", CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_bad_value_of_every_field_is_refused_naming_it(key, value, base_cfg):
    """The composed config with one field set as a Hydra override would set it (Hydra's own parsing is
    covered by the subprocess test below; composing 100+ times would cost half a minute)."""
    from megaframe.config import validate
    from megaframe.config.frozen import thawed

    cfg = thawed(base_cfg)  # a loaded config is frozen: a mutable copy to set one bad value on
    *path, name = key.split(".")
    obj = cfg
    for part in path:
        obj = getattr(obj, part)
    setattr(obj, name, float(value) if not FIELD_RULES[key].integer else int(float(value)))
    with pytest.raises(ConfigError) as info:
        validate(cfg, 1, check_data=False)
    msg = str(info.value)
    assert msg.startswith(f"{key}=") and "\n" not in msg, msg


STAGE = "{{until_step: {s}, until_tokens: {t}, blend: [{{path: /x, weight: {w}}}]}}"
LIST_CASES = [
    ("parallel.pp_layout[1]=-1", ["parallel.pp=2", "parallel.pp_layout=[3,-1]"]),
    ("train.profile_steps[1]=0", ["train.profile_steps=[3,0]"]),
    ("train.memory_snapshot[0]=-2", ["train.memory_snapshot=[-2]"]),
    ("data.blend[0].weight=nan", ["data.blend=[{path: /x, weight: nan}]"]),
    ("data.blend[1].weight=inf", ["data.blend=[{path: /x, weight: 1}, {path: /y, weight: inf}]"]),
    ("data.blend[0].weight=0.0", ["data.blend=[{path: /x, weight: 0}]"]),
    (
        "data.stages[0].until_step=-3",
        [f"data.stages=[{STAGE.format(s=-3, t='null', w=1)}, {STAGE.format(s='null', t='null', w=1)}]"],
    ),
    (
        "data.stages[0].until_tokens=nan",
        [f"data.stages=[{STAGE.format(s='null', t='nan', w=1)}, {STAGE.format(s='null', t='null', w=1)}]"],
    ),
    (
        "data.stages[0].until_tokens=inf",
        [f"data.stages=[{STAGE.format(s='null', t='inf', w=1)}, {STAGE.format(s='null', t='null', w=1)}]"],
    ),
    (
        "data.stages[1].blend[0].weight=-inf",
        [f"data.stages=[{STAGE.format(s=2, t='null', w=1)}, {STAGE.format(s='null', t='null', w='-inf')}]"],
    ),
]


@pytest.mark.parametrize("named,over", LIST_CASES, ids=[n for n, _ in LIST_CASES])
def test_a_bad_number_inside_a_list_is_refused_naming_its_element(named, over):
    """Through Hydra, as a user types it: the element is named with its index, before any later check
    computes with it (until_tokens=nan was a ValueError traceback from math.ceil)."""
    with pytest.raises(ConfigError) as info:
        load_config(["data=synthetic", *over], world_size=2)
    msg = str(info.value)
    assert msg.startswith(named + " ") and "\n" not in msg, msg


def test_table_covers_a_bad_value_per_field():
    assert {k for k, _ in CASES} == {k for k in FIELD_RULES if "[]" not in k}
    assert {n.split("=")[0].replace("[0]", "[]").replace("[1]", "[]") for n, _ in LIST_CASES} == {
        k for k in FIELD_RULES if "[]" in k
    }
    assert len(CASES) >= 2 * len(FIELD_RULES) - 20  # most fields get a low and a high/non-finite probe


@pytest.mark.parametrize(
    "override,needle",
    [
        ("optim.lr=inf", "optim.lr=inf must be finite"),
        ("model.rope_theta=0", "model.rope_theta=0.0 must be > 0"),
        ("train.seed=0.5", "train.seed"),
        (
            "optim.grad_reduce_dtype=bf16",
            "optim.grad_reduce_dtype=bf16 needs train.precision=bf16 (got train.precision=fp32)",
        ),
    ],
)
def test_train_exits_2_before_any_process_group(override, needle, tmp_path):
    # rank 0 of 2 (a rendezvous would fail, not hang), as a fork of the suite's warm interpreter
    # (tests/e2e/warm_start.py): the subject is the refusal, not the interpreter's start
    ranks = dict(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    res = run(
        [sys.executable, "train.py", override, "data=synthetic", f"run.dir={tmp_path}"], timeout=120, **ranks
    )
    assert res.returncode == 2 and needle in res.stderr and len(res.stderr.strip().splitlines()) == 1, (
        res.stderr
    )
    assert not any(tmp_path.iterdir())  # nothing written


def test_default_run_name_is_unique_within_a_millisecond(monkeypatch):
    for var in ("MEGAFRAME_RUN_NAME", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    names = {default_run_name() for _ in range(50)}  # many fall in the same second and millisecond
    assert len(names) == 50
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert default_run_name().endswith("-job4242")


def test_a_bad_data_vocab_size_is_named_before_the_model_size_derived_from_it():
    """model.vocab_size left unset is worked out from data.vocab_size: prepare's `data.vocab_size=0` was
    refused as `model.vocab_size=0`, a key the user never typed."""
    for value in ("0", "-5"):
        with pytest.raises(ConfigError, match=rf"^data\.vocab_size={value} must be"):
            load_config(["data=synthetic", f"data.vocab_size={value}"], world_size=1)
