"""Settings from outside the command line: checkpoint.resume=PATH fills model.* from the checkpoint and
refuses a contradicting override in one line; WANDB_MODE wins unless logging.wandb.mode is given."""

from __future__ import annotations

import dataclasses

import pytest

from megaframe.checkpoint import sharded
from megaframe.config import ConfigError, load_config
from megaframe.parallel.mesh import single_process_mesh
from tests.forms import build_model

SMALL = [
    "data=synthetic",
    "model.num_layers=3",
    "model.hidden_size=48",
    "model.num_attention_heads=6",
    "model.num_query_groups=3",
    "model.ffn_hidden_size=80",
    "model.seq_length=24",
    "model.vocab_size=200",
]


class WeightsOnly:
    def logical_state(self, p) -> dict:
        return {}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = load_config(SMALL, world_size=1)
    mesh = single_process_mesh()
    path = sharded.save(
        tmp_path_factory.mktemp("adopt"),
        2,
        build_model(cfg, mesh),
        WeightsOnly(),
        mesh,
        {"config": dataclasses.asdict(cfg)},
    )
    return path, cfg


def test_resume_takes_the_checkpoints_model(ckpt):
    path, saved = ckpt
    cfg = load_config(["data=synthetic", f"checkpoint.resume={path}"], world_size=1)
    assert cfg.model == saved.model  # the gpt_tiny defaults were all replaced
    cfg = load_config(
        ["data=synthetic", f"checkpoint.resume={path}", "model.hidden_size=48", "model.dropout=0.1"],
        world_size=1,
    )  # an equal size and a weightless field are accepted
    assert cfg.model.hidden_size == 48 and cfg.model.dropout == 0.1 and cfg.model.num_layers == 3


@pytest.mark.parametrize(
    "override,field", [("model.hidden_size=64", "hidden_size"), ("model=gpt2_tiny", "family")]
)
def test_a_contradicting_override_is_one_line(ckpt, override, field):
    path, saved = ckpt
    with pytest.raises(ConfigError) as info:
        load_config(["data=synthetic", f"checkpoint.resume={path}", override], world_size=1)
    msg = str(info.value)
    assert (
        "\n" not in msg and f"model.{field}=" in msg and f"model.{field}={getattr(saved.model, field)}" in msg
    )


def test_wandb_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert load_config(["data=synthetic"], world_size=1).logging.wandb.mode == "disabled"
    assert (
        load_config(["data=synthetic", "logging.wandb.mode=offline"], world_size=1).logging.wandb.mode
        == "offline"
    )
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    assert load_config(["data=synthetic"], world_size=1).logging.wandb.mode == "offline"
    monkeypatch.setenv("WANDB_MODE", "loud")
    with pytest.raises(ConfigError, match="WANDB_MODE"):
        load_config(["data=synthetic"], world_size=1)


def test_missing_prepared_data_names_the_exact_command(tmp_path):
    with pytest.raises(ConfigError) as info:  # the demo at another path: prepare needs only that path
        load_config([f"data.path={tmp_path / 'demo'}"], world_size=1)
    assert f"prepare it with: python -m megaframe.data.prepare data.path={tmp_path / 'demo'}" in str(
        info.value
    )
    with pytest.raises(ConfigError) as info:  # a corpus of one's own: its source and path
        load_config([f"data.path={tmp_path / 'web'}", "data.name=web", "data.source=/texts"], world_size=1)
    assert f"data.source=/texts data.path={tmp_path / 'web'}" in str(info.value) and "\n" not in str(
        info.value
    )


def test_a_preset_that_leaves_a_field_unset_resumes(tmp_path):
    """The README's resume line: model=gpt_tiny leaves vocab_size to the data, so the checkpoint's counts
    as no contradiction (it was refused: 'model.vocab_size=None contradicts ...')."""
    cfg = load_config(["data=synthetic", "model=gpt_tiny", "model.vocab_size=300"], world_size=1)
    path = sharded.save(
        tmp_path,
        2,
        build_model(cfg, single_process_mesh()),
        WeightsOnly(),
        single_process_mesh(),
        {"config": dataclasses.asdict(cfg)},
    )
    again = load_config(["data=synthetic", "model=gpt_tiny", f"checkpoint.resume={path}"], world_size=1)
    assert again.model.vocab_size == 300 and again.model == cfg.model
    with pytest.raises(
        ConfigError, match="model.hidden_size=64 contradicts"
    ):  # what the user typed is still checked
        load_config(
            ["data=synthetic", "model=gpt_tiny", "model.hidden_size=64", f"checkpoint.resume={path}"],
            world_size=1,
        )
