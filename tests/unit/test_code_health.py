"""Code health: no import cycles in megaframe/, with imports inside functions counted (a function-level
import hides a cycle from the interpreter, not from a reader). Uses scripts/dev/code_stats.py's
definitions."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _code_stats():
    spec = importlib.util.spec_from_file_location("code_stats", ROOT / "scripts" / "dev" / "code_stats.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def package_stats() -> dict:
    """code_stats.stats() of the package, computed once for the checks that read it (~2.5 s of CPU each)."""
    return _code_stats().stats()


def test_no_import_cycles(package_stats):
    cycles = package_stats["import_cycles"]
    assert not cycles, f"import cycles: {[' <-> '.join(c) for c in cycles]}"


def test_function_level_import_counts_as_an_edge():
    """The definition the test relies on: an import inside a function is an edge, so a cycle through it
    is found (a checker that only read module-level imports would pass the old config <-> checks loop)."""
    cs = _code_stats()
    known = {"megaframe.a", "megaframe.b"}
    a = ast.parse("from megaframe.b import x\n")
    b = ast.parse("def f():\n    from megaframe.a import y\n")
    graph = {
        "megaframe.a": cs.imports(a, "megaframe.a", False, known),
        "megaframe.b": cs.imports(b, "megaframe.b", False, known),
    }
    assert cs.cycles(graph) == [["megaframe.a", "megaframe.b"]]


def test_config_public_path_unchanged():
    """The schema moved to megaframe.config.schema (a leaf); megaframe.config still exports the same names."""
    import megaframe.config as config
    import megaframe.config.schema as schema

    for name in (
        "Config",
        "ModelConfig",
        "ParallelConfig",
        "TrainConfig",
        "OptimConfig",
        "DataConfig",
        "CheckpointConfig",
        "LoggingConfig",
        "WandbConfig",
        "RunConfig",
        "BlendSource",
        "LRSchedule",
        "DocSplit",
        "ConfigError",
        "ROOT",
        "CONF_DIR",
        "DEFAULT_EXTENSIONS",
        "Norm",
        "Activation",
        "PositionEmbedding",
        "RouterScore",
        "ScheduleKind",
        "Device",
        "Precision",
        "Recompute",
        "DataKind",
        "WandbMode",
    ):
        assert getattr(config, name) is getattr(schema, name), name
    assert callable(config.load_config) and callable(config.validate) and callable(config.default_run_name)


def test_closed_string_choices_are_enums():
    """Hydra refuses a value outside the Enum at composition; what is recorded (checkpoint metadata,
    wandb config) is plain strings that read back into the schema."""
    import json
    from enum import Enum

    from omegaconf import OmegaConf

    from megaframe.config import load_config
    from megaframe.config.schema import Config, enum_fields, plain

    closed = {
        "ModelConfig": {"norm", "activation", "position_embedding", "moe_router_score"},
        "ParallelConfig": {"pp_schedule"},
        "TrainConfig": {"precision", "recompute", "device"},
        "OptimConfig": {"lr_schedule", "grad_reduce_dtype"},
        "DataConfig": {"kind", "split"},
        "WandbConfig": {"mode"},
    }
    import megaframe.config.schema as schema

    for cls, names in closed.items():
        assert names <= enum_fields(getattr(schema, cls)).keys(), cls
    cfg = load_config(
        ["parallel.pp=2", "parallel.pp_schedule=1f1b", "train.recompute=full"], world_size=2, check_data=False
    )
    assert cfg.parallel.pp_schedule == "1f1b" and f"{cfg.train.recompute}" == "full"
    text = json.dumps(plain(cfg))
    assert '"pp_schedule": "1f1b"' in text and "ScheduleKind" not in text
    back = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), json.loads(text)))
    assert back.parallel.pp_schedule == cfg.parallel.pp_schedule and isinstance(back.train.recompute, Enum)
    assert "pp_schedule: 1f1b" in OmegaConf.to_yaml(OmegaConf.structured(cfg))


def test_write_atomic_replaces_whole_or_not_at_all(tmp_path):
    from megaframe.atomic import write_atomic

    p = tmp_path / "x.json"
    write_atomic(p, "old")
    write_atomic(p, b"new")
    assert p.read_text() == "new"
    try:
        write_atomic(p, object())  # fails inside the write: the old content stays, no temporary is left
    except TypeError:
        pass
    assert p.read_text() == "new" and [f.name for f in tmp_path.iterdir()] == ["x.json"]


def test_programming_error_in_composition_is_not_bad_config(monkeypatch):
    """Only Hydra/OmegaConf errors become ConfigError (exit 2); a bug keeps its traceback (main turned
    every Exception into 'bad config')."""
    import pytest
    from omegaconf import OmegaConf

    from megaframe.config import ConfigError, load_config

    def buggy(*a, **k):
        raise TypeError("a bug, not a bad setting")

    monkeypatch.setattr(OmegaConf, "to_object", buggy)
    with pytest.raises(TypeError):
        load_config([], world_size=1, check_data=False)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="train.max_steps"):
        load_config(["train.max_steps=abc"], world_size=1, check_data=False)


def test_a_bad_choice_from_a_file_names_its_field():
    """A value merged from a YAML file (no override text to quote) still names the field in the line."""
    import pytest
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from megaframe.config.loading import _composition_error
    from megaframe.config.schema import Config

    with pytest.raises(OmegaConfBaseException) as e:
        OmegaConf.merge(OmegaConf.structured(Config), {"train": {"precision": "fp16"}})
    line = _composition_error(e.value)
    assert line.startswith("train.precision: ") and "fp32, bf16" in line and "\n" not in line, line


def test_no_collective_outside_comm(package_stats):
    """Every collective and p2p transfer goes through megaframe/parallel/comm/ (bytes counted, the
    watchdog's ring buffer fed, virtual axes honoured); the NCCL emulation below comm is the one other
    file."""
    assert package_stats["collectives_outside_comm"] == []


def test_the_collective_check_bites():
    tree = ast.parse("import torch.distributed as dist\ndef f(x, g):\n    dist.all_reduce(x, group=g)\n")
    assert _code_stats().collectives_outside_comm(tree) == [(3, "dist.all_reduce")]
