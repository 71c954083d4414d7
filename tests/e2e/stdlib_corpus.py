"""A corpus the project has never seen, built offline and deterministically on any machine with Python:
the docstrings of the Python standard library (read with `ast`, never imported, so no module runs),
plus the license texts under /usr/share/common-licenses when the machine has them (Debian does).

One plain-text file per top-level stdlib module or package, docstrings separated by blank lines:
about 1.9 MB of English prose and code examples on CPython 3.11. The text depends on the exact Python
build (it is the same on every run of one machine), which is all the tests need.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = (ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, kinds))
    return [d.strip() for d in docs if d and d.strip()]


def write_corpus(folder: Path) -> Path:
    """Write the corpus into `folder` (created); returns it."""
    root = Path(sysconfig.get_paths()["stdlib"])
    groups: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP & set(rel.parts):
            continue
        groups.setdefault(rel.parts[0].removesuffix(".py"), []).extend(_docstrings(path))
    folder.mkdir(parents=True, exist_ok=True)
    for name, docs in groups.items():
        if docs:
            (folder / f"{name}.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    licenses = Path("/usr/share/common-licenses")
    if licenses.is_dir():
        for lic in sorted(p for p in licenses.iterdir() if p.is_file()):
            (folder / f"license-{lic.name}.txt").write_text(lic.read_text(errors="replace"), encoding="utf-8")
    return folder


if __name__ == "__main__":
    import sys

    out = write_corpus(Path(sys.argv[1]))
    print(f"{sum(f.stat().st_size for f in out.iterdir()) / 1e6:.2f} MB in {len(list(out.iterdir()))} files")
