"""The user-facing HF scripts (scripts/export_hf.py, scripts/import_hf.py) loaded as modules, for the tests
that call their functions directly (the scripts are files, not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


export_hf, import_hf = script("export_hf"), script("import_hf")
