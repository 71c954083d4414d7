"""`python train.py --help`: the config groups with their presets (each preset's first comment line) and the
keys a first run sets, each with its default and the first sentence of its schema docstring. Read from
conf/ and the schema, never written twice: a new preset or a changed default shows up by itself."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing

from megaframe.config.schema import CONF_DIR, Config

MAIN_KEYS = (
    "train.max_steps",
    "train.global_batch_size",
    "train.micro_batch_size",
    "train.log_interval",
    "optim.lr",
    "optim.warmup_steps",
    "model.seq_length",
    "parallel.tp",
    "parallel.pp",
    "optim.zero",
    "run.dir",
    "checkpoint.interval",
    "checkpoint.resume",
    "data.path",
    "logging.wandb.mode",
)
"""The keys `--help` lists (docs/config.md holds them all)."""


def field_docs(cls: type) -> dict[str, str]:
    """name -> the string literal right under the field in the class body (PEP 257's attribute docstring).
    `checkpoint.async` is declared as `locals()["async"] = field(...)` (a keyword), read the same way."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    docs, last = {}, None
    for stmt in tree.body[0].body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            last = stmt.target.id
        elif isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Subscript):
            key = stmt.targets[0].slice
            last = key.value if isinstance(key, ast.Constant) else None
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and last:
            if isinstance(stmt.value.value, str):
                docs[last] = " ".join(stmt.value.value.split())
            last = None
        else:
            last = None
    return docs


def _field(key: str) -> tuple[dataclasses.Field, type]:
    """The schema field of a dotted key and the dataclass that declares it."""
    cls, parts = Config, key.split(".")
    for name in parts[:-1]:
        cls = typing.get_type_hints(cls)[name]  # the schema's annotations are strings
    return {f.name: f for f in dataclasses.fields(cls)}[parts[-1]], cls


def _default(f: dataclasses.Field):
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return getattr(value, "value", value)


def key_lines() -> list[str]:
    out = []
    for key in MAIN_KEYS:
        f, cls = _field(key)
        doc = field_docs(cls).get(f.name, "")
        value = _default(f)
        out.append(f"  {key}={value if value != '' else repr(value)}".ljust(40) + f" {_short(doc, 68)}")
    return out


def _short(text: str, width: int) -> str:
    """The first sentence of `text`, cut to `width` columns (the help stays one screen wide)."""
    first = text.split(". ")[0]
    # a parenthesis is detail, unless it is the description itself (checkpoint.resume's choices)
    first = first.split(" (")[0] if len(first.split(" (")[0]) > 20 else first
    first = first.rstrip(".:;")
    return first if len(first) <= width else first[: width - 3].rstrip(" ,") + "..."


def group_lines() -> list[str]:
    out = []
    for group in sorted(p for p in CONF_DIR.iterdir() if p.is_dir()):
        out.append(f"  {group.name}=NAME:")
        for preset in sorted(group.glob("*.yaml")):
            comments = [
                ln.lstrip("# ").strip()
                for ln in preset.read_text().splitlines()
                if ln.startswith("#") and "@package" not in ln
            ]
            # the description gets what the name leaves of the help's 110 columns
            name = f"    {preset.stem:<14} "
            out.append(name + (_short(comments[0], 110 - len(name)) if comments else ""))
    return out


def usage() -> str:
    return "\n".join(
        [
            "usage: python train.py [KEY=VALUE ...] [--cfg] [--help]  (Hydra overrides)",
            "",
            "config groups (conf/; default model=gpt_tiny data=demo):",
            *group_lines(),
            "",
            "main keys (schema defaults; a preset may set others, `--cfg` prints the composed config):",
            *key_lines(),
            "",
            "every key, its type, default and meaning: docs/config.md",
            "e.g. python train.py model=gpt2_tiny data=synthetic train.max_steps=20 optim.warmup_steps=2",
        ]
    )
