"""lm-eval's TaskManager over only the task YAMLs that can define the names asked for.

Why: lm-eval indexes every one of its ~14,000 built-in YAMLs (parsed in Python) to find one task: 10 s to
over a minute of CPU per process, paid by `python -m megaframe.evaluate +tasks=arc_easy` and by each
training process that scores a hub task. A YAML can define a name (as its task, group or tag) only if the
name is in its text or in the text of a file it includes, so reading the raw bytes finds every candidate
(~1 s); lm-eval then indexes those alone, in its own order, with the same result for the names asked for.
A group asked for brings the names its members list, until none is new.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

# lm-eval's walk (lm_eval/tasks/_index.py): every *.yaml below the folder but these
_IGNORE_DIRS = {"__pycache__", ".ipynb_checkpoints"}
# `include: x`, `include: [x, y]` or a block list below it; also one nested in a list item, so the text
# taken is never less than what lm-eval may read
_INCLUDE = re.compile(rb"^[ \t-]*include:[ \t]*([^\n#]*)((?:\n[ \t]*-[ \t]*[^\n#]*)*)", re.M)


def yaml_files(root: Path) -> list[Path]:
    """The YAMLs lm-eval indexes below `root`, in its order (later duplicates lose to earlier ones)."""
    files = [
        Path(d) / f
        for d, dirs, names in os.walk(root)
        if not _IGNORE_DIRS & set(Path(d).relative_to(root).parts)
        for f in names
        if f.endswith(".yaml")
    ]
    return sorted(files, key=lambda p: p.as_posix())


def _includes(text: bytes) -> list[str]:
    out = []
    for inline, block in _INCLUDE.findall(text):
        inline = inline.strip().strip(b"[]")
        items = inline.split(b",") if inline else [ln.split(b"-", 1)[1] for ln in block.splitlines()[1:]]
        out += [i.strip().strip(b"'\"").decode("utf-8", "replace") for i in items if i.strip()]
    return out


def _closure_text(path: str, texts: dict, seen: frozenset = frozenset()) -> bytes:
    """`path`'s bytes and those of every file it includes (relative to its folder, as lm-eval's load_yaml
    reads them)."""
    if path in texts:
        return texts[path]
    try:
        own = Path(path).read_bytes()
    except OSError:
        try:  # lm-eval resolves links before it joins an include: a `..` through a linked folder
            own = Path(os.path.realpath(path)).read_bytes()
        except OSError:
            own = b""  # lm-eval skips a YAML it cannot read
    if path in seen:  # an include cycle: lm-eval refuses the file
        return own
    folder = os.path.dirname(path)
    parts = [own] + [
        _closure_text(os.path.normpath(os.path.join(folder, inc)), texts, seen | {path})
        for inc in _includes(own)
    ]
    texts[path] = b"\n".join(parts)
    return texts[path]


# the characters of a task name: a mention has none of them on either side
_NAME_CHARS = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def mentions(text: bytes, name: bytes) -> bool:
    """Whether `name` is in `text` as a whole word (not part of a longer task name: mmlu in cmmlu_x)."""
    at = text.find(name)
    while at >= 0:
        end = at + len(name)
        if (at == 0 or text[at - 1] not in _NAME_CHARS) and (
            end == len(text) or text[end] not in _NAME_CHARS
        ):
            return True
        at = text.find(name, at + 1)
    return False


def _member_names(value) -> set[str]:
    """Every string a group's `task:` list holds (its members' names, nested inline groups' too)."""
    if isinstance(value, str):
        return {value}
    if isinstance(value, dict):
        return set().union(*(_member_names(v) for k, v in value.items() if k in ("task", "group")))
    if isinstance(value, list):
        return set().union(*(_member_names(v) for v in value))
    return set()


def subset_manager(names: list[str], root: Path, include_path: str | None = None):
    """TaskManager(include_path=[the YAMLs under `root` that can define `names` or what they need,
    include_path]) without lm-eval's defaults: the entries of `names` are what the full index gives."""
    from lm_eval.tasks import TaskManager

    files, texts = yaml_files(root), {}
    text = [(f, _closure_text(str(f), texts)) for f in files]
    wanted = set(names)
    while True:
        keys = [n.encode() for n in wanted]
        chosen = [f for f, t in text if any(mentions(t, k) for k in keys)]
        manager = _manager(TaskManager, chosen, include_path)
        index = manager.task_index
        groups = [index[n] for n in wanted if n in index and index[n].kind.name == "GROUP"]
        more = set().union(*(_member_names((g.cfg or {}).get("task")) for g in groups))
        if more <= wanted:
            return manager
        wanted |= more


def _manager(task_manager_cls, chosen: list[Path], include_path: str | None):
    """lm-eval's manager over `chosen` (links named in their order) then include_path; the entries then
    name the files themselves (what lm-eval reports as a task's config_source), so the links can go."""
    with tempfile.TemporaryDirectory(prefix="megaframe-tasks-") as tmp:
        links = {}
        for i, f in enumerate(chosen):
            links[str(Path(tmp) / f"{i:06d}.yaml")] = f
            os.symlink(os.path.realpath(f), Path(tmp) / f"{i:06d}.yaml")
        paths = [tmp] + ([str(include_path)] if include_path else [])
        manager = task_manager_cls(include_path=paths, include_defaults=False)
    for entry in manager.task_index.values():
        entry.yaml_path = links.get(str(entry.yaml_path), entry.yaml_path)
    return manager
