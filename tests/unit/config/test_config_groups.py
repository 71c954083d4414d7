"""Components take their own config group and the derived record (megaframe/config/derived.py), not the
whole run config: the root `Config` is imported, and its groups read off one object (`cfg.train.x`,
`self.cfg.model.y`), only by the modules ROOT_CONFIG_READERS names, each with its reason. Everything else
receives `DataConfig`, `TrainConfig`, `ModelConfig`, ... plus `Derived` or an explicit value, so what a
component depends on is in its signature.

What counts as reading the whole config: importing `Config` from megaframe.config (any of its modules), or
an attribute `<group>` (a field of `Config`: model, parallel, train, ...) read off a name or attribute
called `cfg` or `config`. No group has a field named like a root group, so `cfg.data` is the root config's
data group wherever it appears.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from megaframe.config.schema import Config

ROOT = Path(__file__).resolve().parents[3]
GROUPS = frozenset(f.name for f in dataclasses.fields(Config))
HOLDERS = frozenset({"cfg", "config"})

# "path" (a module), "path/" (a package) or "path:function" -> why it may read the whole run config
ROOT_CONFIG_READERS: dict[str, str] = {
    "megaframe/config/": "the config itself: composes it, checks fields against each other, adopts a"
    " checkpoint's settings and derives the record the components receive",
    "megaframe/training/trainer.py": "the loop's wiring: hands each component its group and the derived"
    " record",
    "megaframe/training/startup.py": "the wiring: builds the model, data, evaluator, sampler and meter from"
    " the run config, and prints the header that names every group",
    "megaframe/training/header.py": "the start-up header, which names every group of the run config (the"
    " wiring's printing, apart from startup.py)",
    "megaframe/checkpoint/whole_load.py": "megaframe.load_model's body: rebuilds the whole config a"
    " checkpoint recorded",
    "megaframe/training/checkpointing.py": "checkpoint metadata records the whole config (config.yaml's"
    " copy a resume compares against and load_model rebuilds)",
    "megaframe/checkpoint/resume.py": "a resume compares the whole saved config to this run's and may"
    " continue another run's checkpoint folder",
    "megaframe/checkpoint/resume_checks.py": "the field-by-field comparison of the saved config and this"
    " run's, over every group",
    "megaframe/tracking.py": "logs the whole config to wandb with the run's id and name",
    "megaframe/planning/": "plans whole runs: every candidate layout is a whole config (parallel, train,"
    " optim and model together)",
    "megaframe/plan.py": "command line: composes the run config and plans it",
    "megaframe/generate.py": "command line: composes a config around a checkpoint and generates",
    "megaframe/evaluate.py": "command line: composes a config around a checkpoint and scores it",
    "megaframe/plot.py": "command line: reads a run folder's config.yaml (plain YAML, not the schema)",
    "megaframe/evaluation/layout_lm.py": "the lm-eval command line in a parallel layout: composes a config"
    " around a checkpoint like evaluate.py",
    "megaframe/data/prepare/__init__.py": "`python -m megaframe.data.prepare` composes a config",
    "megaframe/__init__.py": "megaframe.load_model rebuilds the whole config a checkpoint recorded",
    "megaframe/training/phase_run.py": "runs the trainer's start-up, step, save and load for a whole run"
    " config: the planner's phase figures are checked against it",
    "megaframe/checkpoint/offline_plans.py:rank_items": "checkpoint layouts planned without hardware for a"
    " whole run config, each rank's model built as"
    " the trainer builds it",
}


def _allowed(rel: str, func: str | None, allow: dict[str, str]) -> bool:
    return any(
        rel == key or (key.endswith("/") and rel.startswith(key)) or (func and key == f"{rel}:{func}")
        for key in allow
    )


def _reads(tree: ast.AST) -> list[tuple[int, str, str | None]]:
    """(line, what, enclosing top-level function or method) of every whole-config read in a module."""
    out = []

    def visit(node: ast.AST, func: str | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name if func is None or func.startswith("class ") else func
        elif isinstance(node, ast.ClassDef):
            func = f"class {node.name}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megaframe.config"):
            out.extend((node.lineno, "imports Config", func) for a in node.names if a.name == "Config")
        if isinstance(node, ast.Attribute) and node.attr in GROUPS:
            v = node.value
            name = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None
            if name in HOLDERS:
                out.append((node.lineno, f"reads {name}.{node.attr}", func))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, None)
    return out


def breaches(root: Path, allow: dict[str, str]) -> list[str]:
    """One line per whole-config read outside the allowed modules and functions."""
    found = []
    for f in sorted((root / "megaframe").rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        for line, what, func in _reads(ast.parse(f.read_text())):
            if not _allowed(rel, func, allow):
                found.append(f"{rel}:{line} {what}: take the group (and Derived) instead")
    return found


def test_only_the_wiring_reads_the_whole_config():
    found = breaches(ROOT, ROOT_CONFIG_READERS)
    assert not found, "\n".join(found)


def test_every_allowance_names_a_reason_and_something_that_exists():
    for key, why in ROOT_CONFIG_READERS.items():
        path, _, func = key.partition(":")
        assert len(why.split()) >= 5, f"{key}: say why it needs the whole config"
        assert (ROOT / path).exists(), key
        assert not func or f"def {func}(" in (ROOT / path).read_text(), key


def test_the_rule_finds_each_kind_of_read_in_a_small_tree(tmp_path):
    pkg = tmp_path / "megaframe" / "data"
    pkg.mkdir(parents=True)
    (pkg / "reader.py").write_text(
        "from megaframe.config.schema import Config, DataConfig\n"
        "def samples(cfg):\n    return cfg.data.path, cfg.model.seq_length\n"
        "class Eval:\n    def due(self, step):\n        return step % self.cfg.train.eval_interval\n"
        "def narrow(cfg: DataConfig, seq: int):\n    return cfg.path, seq\n"
        "def wrapper(cfg):\n    return narrow(cfg.data, cfg.model.seq_length)\n"
    )
    found = breaches(tmp_path, {})
    text = "\n".join(found)
    assert "megaframe/data/reader.py:1 imports Config" in text
    assert "reader.py:3 reads cfg.data" in text and "reader.py:3 reads cfg.model" in text
    assert "reader.py:6 reads cfg.train" in text
    assert len(found) == 6, text  # the group's own fields (cfg.path) are not whole-config reads
    left = breaches(tmp_path, {"megaframe/data/reader.py:wrapper": "the outside form", "megaframe/x/": "x"})
    assert len(left) == 4 and not any(":10 " in line for line in left), left
    assert breaches(tmp_path, {"megaframe/data/": "the whole package"}) == []
