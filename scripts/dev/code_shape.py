"""The shape of megaframe/ a reader relies on, checked (tests/unit/test_code_shape.py):

- every file (megaframe/, scripts/, benchmarks/) at most MAX_FILE_LINES lines and every function of
  megaframe/ at most MAX_FUNC_LINES lines, except the entries of ALLOW (each carries the reason it is longer);
- no import cycle between modules (imports inside functions count: they hide a cycle from the
  interpreter, not from a reader);
- no two files share a name (`__init__.py` and `__main__.py` aside): a name says which file it is;
- no upward import: the packages lie in the order of LAYERS (docs/architecture.md, "Layers"), and a
  module imports only from its own layer or the ones before it.

    python scripts/dev/code_shape.py     # one line per breach, exit 1 when there is any
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 450
MAX_FUNC_LINES = 60

# Bottom to top. A unit is megaframe/<name> (a package or a top-level module) or a dotted module inside one
# (config.schema); "" is megaframe/__init__.py.
LAYERS = [
    # leaves: error types, file write, the config schema
    # (a module of megaframe/config named here is its own unit)
    [
        "errors",
        "atomic",
        "atomic_lock",
        "quiet",
        "paths",
        "config.choices",
        "config.frozen",
        "config.data_schema",
        "config.model_schema",
        "config.train_schema",
        "config.optim_schema",
        "config.schema",
        "config.numeric_rule",
        "config.rules",
    ],
    ["parallel"],  # mesh, collectives, launch env: knows no model
    ["pipeline"],  # stages, schedules as data, their executor: runs any chunk module
    ["layers"],  # parallel linear/embedding/norm on the mesh
    ["optim"],  # grads, ZeRO, LR: works on Placements, knows no model
    ["model"],  # blocks built from layers
    ["models"],  # one spec per family: its block, its check, presets, HF adapter, counters
    ["model.parallelize"],  # the one builder: the stage shell around the family's blocks, sliced and cast
    ["data"],  # tokenizer, shards, sample order
    ["checkpoint"],  # save, load, resume, HF conversion
    ["runops"],  # who may write here, signals, watchdog, faults
    ["config"],  # composes, adopts a checkpoint, asks each package's rule
    ["data.prepare"],  # `python -m megaframe.data.prepare`: a command line that composes a config
    ["inference", "tracking"],  # generation on a loaded model; metrics sinks
    ["evaluation"],  # lm-evaluation-harness on a loaded or live model, any layout
    ["training"],  # the loop
    ["planning"],  # memory and time models (reads the loop's meters and FLOPs)
    [
        "plan",
        "generate",
        "evaluate",
        "plot",
        "plot_views",
        "goodput",
        "",
    ],  # command lines and the package's public surface
]

# Held to the file limit too. Their functions are not held to MAX_FUNC_LINES: a misuse script's function is
# a flat list of attempts and a benchmark's main a list of cases, each read top to bottom, which a split
# into helpers would scatter without making one of them simpler.
TOOL_FOLDERS = ("scripts", "benchmarks")

# "path" or "path:function" -> why it may be longer than the limit
ALLOW: dict[str, str] = {
    "scripts/gpu_figures.py": "the one-GPU figures share module state (device, budget, arguments) across"
    " their builders; split where it next runs on a GPU, so the split is timed there",
}

# (importer unit, imported unit) -> why an upward edge is allowed (none today: tests/unit/test_code_shape.py
# holds it empty, so a new one is a move or a layer of its own, not an allowance)
UPWARD_ALLOW: dict[tuple[str, str], str] = {}


def _code_stats():
    spec = importlib.util.spec_from_file_location("code_stats", Path(__file__).with_name("code_stats.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _module(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(mod: str, layers: list[list[str]] | None = None) -> str:
    """megaframe/<name>, or the longest dotted sub-unit LAYERS names (config.schema: a leaf inside config)."""
    parts = mod.split(".")[1:]
    named = {u for layer in layers or [] for u in layer}
    return next(
        (".".join(parts[:k]) for k in range(len(parts), 1, -1) if ".".join(parts[:k]) in named),
        parts[0] if parts else "",
    )


def layer_of(name: str, layers: list[list[str]]) -> int | None:
    return next((i for i, group in enumerate(layers) if name in group), None)


def sizes(
    root: Path, allow: dict[str, str], max_file: int = MAX_FILE_LINES, max_func: int = MAX_FUNC_LINES
) -> list[str]:
    """Files and functions over their limit and not allowed: every file of megaframe/, scripts/ and
    benchmarks/; functions in megaframe/ (see TOOL_FOLDERS)."""
    out = []
    files = [f for top in ("megaframe", *TOOL_FOLDERS) for f in sorted((root / top).rglob("*.py"))]
    for f in files:
        rel = f.relative_to(root).as_posix()
        text = f.read_text()
        n = len(text.splitlines())
        if n > max_file and rel not in allow:
            out.append(f"{rel}: {n} lines > {max_file}")
        if not rel.startswith("megaframe/"):
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > max_func and f"{rel}:{node.name}" not in allow:
                    out.append(f"{rel}:{node.lineno} {node.name}: {length} lines > {max_func}")
    return out


def graph(root: Path) -> dict[str, set[str]]:
    cs = _code_stats()
    files = sorted((root / "megaframe").rglob("*.py"))
    known = {_module(root, f) for f in files}
    return {
        _module(root, f): cs.imports(
            ast.parse(f.read_text()), _module(root, f), f.name == "__init__.py", known
        )
        for f in files
    }


def upward(g: dict[str, set[str]], layers: list[list[str]], allow: dict[tuple[str, str], str]) -> list[str]:
    """Imports of a unit in a later layer, and units that no layer names."""
    out = []
    for mod, deps in sorted(g.items()):
        src = unit(mod, layers)
        if layer_of(src, layers) is None:
            out.append(f"{mod}: megaframe/{src} is in no layer (add it to LAYERS and docs/architecture.md)")
            continue
        for dep in sorted(deps):
            dst = unit(dep, layers)
            if dst == src or (src, dst) in allow or layer_of(dst, layers) is None:
                continue
            if layer_of(dst, layers) > layer_of(src, layers):
                out.append(f"{mod} imports {dep}: {dst or 'megaframe'} lies above {src or 'megaframe'}")
    return out


def shared_names(root: Path) -> list[str]:
    """Two files of one name; a family folder's files (megaframe/models/<family>/spec.py, hf.py) are named
    by their role in every family, as torchtitan's model folders are, so they count as '<family>/<name>'."""
    by_name: dict[str, list[str]] = {}
    for f in sorted((root / "megaframe").rglob("*.py")):
        if f.name not in ("__init__.py", "__main__.py"):
            rel = f.relative_to(root)
            key = f"{rel.parts[2]}/{f.name}" if rel.parts[1] == "models" and len(rel.parts) == 4 else f.name
            by_name.setdefault(key, []).append(rel.as_posix())
    return [f"{name} shared by {', '.join(paths)}" for name, paths in by_name.items() if len(paths) > 1]


def check(root: Path = ROOT, layers=LAYERS, allow=ALLOW, upward_allow=UPWARD_ALLOW) -> list[str]:
    g = graph(root)
    found = sizes(root, allow) + shared_names(root)
    found += [f"import cycle: {' <-> '.join(c)}" for c in _code_stats().cycles(g)]
    return found + upward(g, layers, upward_allow)


def main() -> int:
    found = check()
    print(*found, sep="\n")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
