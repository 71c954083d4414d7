"""Code-health figures for megaframe/: lines of code, comment density, import cycles, collectives
called outside parallel/comm/, and the longest functions.

    python scripts/dev/code_stats.py [--json]

Definitions (so the figures can be compared across commits):
- code line: a non-blank line that holds a token other than a comment, excluding docstrings;
- comment line: a line that holds a `#` comment (full-line or trailing);
- import graph: every `import`/`from ... import` of a megaframe module anywhere in a file (also inside
  functions), edges between modules; a cycle is a strongly connected component of more than one module;
- collective outside comm: a call `dist.<name>(...)` / `torch.distributed.<name>(...)` of a
  communication primitive in any file other than megaframe/parallel/comm/ and the backend emulation it
  delegates to (megaframe/parallel/p2p_semantics.py: NCCL's p2p rules on gloo, below comm).
"""

from __future__ import annotations

import ast
import io
import json
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "megaframe"
COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "barrier",
    "monitored_barrier",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "gather",
    "scatter",
    "reduce",
}


COMM_FILES = ("megaframe/parallel/comm/", "megaframe/parallel/p2p_semantics.py")


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(getattr(body[0], "value", None), ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def line_counts(src: str, tree: ast.AST) -> tuple[int, int]:
    """(code lines, comment lines) of one file."""
    doc = _docstring_lines(tree)
    code, comment = set(), set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            comment.add(tok.start[0])
        elif tok.type not in (
            tokenize.NL,
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.ENDMARKER,
            tokenize.ENCODING,
        ):
            for ln in range(tok.start[0], tok.end[0] + 1):
                if ln not in doc:
                    code.add(ln)
    return len(code), len(comment)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(tree: ast.AST, mod: str, is_pkg: bool, known: set[str]) -> set[str]:
    out: set[str] = set()
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            parent = ".".join(base[: len(base) - node.level + 1]) if node.level else ""
            src = ".".join(p for p in (parent, node.module or "") if p)
            subs = [f"{src}.{a.name}" for a in node.names]
            # `from pkg import submodule` only needs the submodule; any other name needs pkg itself
            names = subs + ([src] if any(n not in known for n in subs) else [])
        for n in names:
            # the longest known module prefix of the imported name
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != mod and n.startswith("megaframe"):
                out.add(n)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def collectives_outside_comm(tree: ast.AST) -> list[tuple[int, str]]:
    hits = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in COLLECTIVES
        ):
            owner = ast.unparse(node.func.value)
            if owner in ("dist", "torch.distributed", "c10d"):
                hits.append((node.lineno, f"{owner}.{node.func.attr}"))
    return hits


def functions(tree: ast.AST) -> list[tuple[int, str, int]]:
    return [
        (n.end_lineno - n.lineno + 1, n.name, n.lineno)
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]


def stats() -> dict:
    files = sorted(PKG.rglob("*.py"))
    trees = {f: ast.parse(f.read_text()) for f in files}
    known = {module_name(f) for f in files}
    code = comment = 0
    graph: dict[str, set[str]] = {}
    outside: list[str] = []
    funcs: list[tuple[int, str]] = []
    for f, tree in trees.items():
        c, k = line_counts(f.read_text(), tree)
        code, comment = code + c, comment + k
        mod = module_name(f)
        graph[mod] = imports(tree, mod, f.name == "__init__.py", known)
        rel = str(f.relative_to(ROOT))
        if not any(rel == c or (c.endswith("/") and rel.startswith(c)) for c in COMM_FILES):
            outside += [f"{rel}:{ln} {name}" for ln, name in collectives_outside_comm(tree)]
        funcs += [(n, f"{rel}:{ln} {name}") for n, name, ln in functions(tree)]
    funcs.sort(reverse=True)
    return {
        "files": len(files),
        "code_lines": code,
        "comment_lines": comment,
        "comments_per_100": round(100 * comment / max(code, 1), 1),
        "import_cycles": cycles(graph),
        "collectives_outside_comm": outside,
        "longest_functions": [f"{n} lines {where}" for n, where in funcs[:5]],
        "files_over_400": [
            f"{len(f.read_text().splitlines())} {f.relative_to(ROOT)}"
            for f in files
            if len(f.read_text().splitlines()) > 400
        ],
    }


def main() -> None:
    s = stats()
    if "--json" in sys.argv:
        print(json.dumps(s, indent=1))
        return
    print(
        f"files {s['files']}, code lines {s['code_lines']}, comment lines {s['comment_lines']} "
        f"({s['comments_per_100']} per 100 code lines)"
    )
    print(
        f"import cycles: {len(s['import_cycles'])}",
        *(" <-> ".join(c) for c in s["import_cycles"]),
        sep="\n  ",
    )
    print(
        f"collectives outside parallel/comm/: {len(s['collectives_outside_comm'])}",
        *s["collectives_outside_comm"],
        sep="\n  ",
    )
    print("longest functions:", *s["longest_functions"], sep="\n  ")
    print(f"files over 400 lines: {len(s['files_over_400'])}", *s["files_over_400"], sep="\n  ")


if __name__ == "__main__":
    main()
