"""The config load_config returns is frozen (an assignment raises, naming the key), and the values worked
out from it live in one frozen record (megaframe.config.derived.Derived) equal to what each component
computed for itself before."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from pathlib import Path

import pytest

from megaframe.config import Config, load_config
from megaframe.config.derived import Derived, derive, lr_horizon, settled
from megaframe.config.frozen import FrozenConfigError, is_frozen, thawed
from megaframe.pipeline.schedule import is_v, resolve_kind

FIXTURE = (
    Path(__file__).resolve().parents[2] / "fixtures" / "ckpt_v2_tiny" / "step_00000002" / "metadata.json"
)
TINY = ["data.kind=synthetic", "model=gpt_tiny"]


def _load(*overrides: str, world: int = 1) -> Config:
    return load_config([*TINY, *overrides], world_size=world, check_data=False)


@pytest.mark.parametrize(
    "key, value",
    [
        ("train.max_steps", 3),
        ("model.hidden_size", 64),
        ("run.dir", "/tmp/x"),
        ("logging.wandb.mode", "offline"),
        ("model.rope_scaling.factor", 2.0),
    ],
)
def test_assignment_after_load_raises_naming_the_key(key, value):
    cfg = _load()
    *groups, name = key.split(".")
    target = cfg
    for g in groups:
        target = getattr(target, g)
    before = getattr(target, name)
    with pytest.raises(FrozenConfigError, match=rf"^{key}=.*frozen after load_config"):
        setattr(target, name, value)
    assert getattr(target, name) == before
    with pytest.raises(AttributeError):  # a frozen dataclass's error type: callers may catch either
        setattr(target, name, value)


def test_a_whole_group_cannot_be_swapped_or_deleted():
    cfg = _load()
    with pytest.raises(FrozenConfigError, match="^optim="):
        cfg.optim = dataclasses.replace(cfg.optim, lr=1.0)
    with pytest.raises(FrozenConfigError, match="^train.seed"):
        del cfg.train.seed


def test_copies_stay_frozen_and_replace_builds_a_new_config():
    cfg = _load()
    for twin in (copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):  # spawn workers get a pickled config
        assert twin == cfg and is_frozen(twin) and is_frozen(twin.model.rope_scaling)
        with pytest.raises(FrozenConfigError):
            twin.train.seed = 1
    new = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=7))
    new.train.seed = 8  # a config built by hand is the caller's to fill
    assert cfg.train.seed != 8 and not is_frozen(new)
    again = settled(cfg, train={"seed": 9})
    assert again.train.seed == 9 and cfg.train.seed != 9 and is_frozen(again) and is_frozen(again.train)
    assert again.model is cfg.model  # the groups it does not name are the loaded ones
    loose = thawed(cfg)
    loose.model.rope_scaling.factor = 4.0
    assert loose.model.rope_scaling.factor == 4.0 != cfg.model.rope_scaling.factor and is_frozen(cfg.model)


def test_a_config_built_directly_is_not_frozen():
    cfg = Config()
    cfg.train.seed = 3
    assert cfg.train.seed == 3 and not is_frozen(cfg)


def _old_horizon(cfg: Config, meta: dict | None) -> int:
    """What startup computed before the record: the resumed checkpoint's horizon, else train.max_steps."""
    horizon = cfg.optim.lr_decay_steps
    if horizon is None and meta and int(meta["step"]) != 0:
        saved = meta.get("config", {})
        horizon = saved.get("optim", {}).get("lr_decay_steps") or saved.get("train", {}).get("max_steps")
    return int(horizon or cfg.train.max_steps)


@pytest.mark.parametrize(
    "overrides, world",
    [
        ([], 1),
        (["parallel.tp=2", "train.global_batch_size=8", "train.micro_batch_size=2"], 4),
        (["parallel.pp=2", "model.num_layers=4", "train.global_batch_size=8", "train.micro_batch_size=1"], 4),
        (
            [
                "parallel.pp=2",
                "parallel.vpp=2",
                "model.num_layers=4",
                "train.global_batch_size=8",
                "train.micro_batch_size=1",
            ],
            2,
        ),
        (
            [
                "parallel.pp=2",
                "parallel.vpp=2",
                "parallel.pp_schedule=zbv",
                "model.num_layers=4",
                "train.global_batch_size=8",
                "train.micro_batch_size=1",
            ],
            2,
        ),
        (["optim.lr_decay_steps=40", "train.max_steps=20"], 2),
    ],
)
def test_the_record_equals_what_each_call_site_computed(overrides, world):
    cfg = _load(*overrides, world=world)
    p, t = cfg.parallel, cfg.train
    d = derive(cfg, world, run_id="r@1")
    dp = world // (p.tp * p.pp * p.cp)
    kind = resolve_kind(p.pp_schedule, p.vpp)  # step.py, startup.py, checks.py, model/gpt.py resolved it each
    assert d == Derived(
        dp=dp,
        micro_batches=t.global_batch_size // (t.micro_batch_size * dp),
        tokens_per_step=t.global_batch_size * cfg.model.seq_length,
        pp_schedule=kind,
        v_placement=is_v(kind),
        lr_horizon=cfg.optim.lr_decay_steps or t.max_steps,
        run_id="r@1",
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.dp = 3


@pytest.mark.parametrize(
    "own, step, saved",
    [
        (None, 2, "fixture"),
        (None, 0, "fixture"),
        (7, 2, "fixture"),
        (None, 5, {"train": {"max_steps": 30}}),
        (None, 5, {}),
    ],
)
def test_the_lr_horizon_a_resume_adopts_is_the_one_startup_adopted(own, step, saved):
    """Against the metadata of a checkpoint written by the code before the config froze."""
    meta = json.loads(FIXTURE.read_text())
    meta = {**meta, "step": step, **({} if saved == "fixture" else {"config": saved})}
    cfg = _load(
        "train.max_steps=12", "optim.warmup_steps=2", *([f"optim.lr_decay_steps={own}"] if own else [])
    )
    assert lr_horizon(cfg.optim, cfg.train, meta) == _old_horizon(cfg, meta)
    assert lr_horizon(cfg.optim, cfg.train, None) == _old_horizon(cfg, None)
    assert derive(cfg, 1, meta).lr_horizon == _old_horizon(cfg, meta)
