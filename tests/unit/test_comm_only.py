"""Every collective and point-to-point transfer goes through megaframe/parallel/comm.py (bytes counted,
the watchdog's ring buffer fed, virtual axes honoured): a `dist.<collective>(...)` call anywhere else in
megaframe/ fails this test (scripts/code_stats.py holds the definition)."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _code_stats():
    spec = importlib.util.spec_from_file_location("code_stats", ROOT / "scripts" / "code_stats.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_collective_outside_comm():
    assert _code_stats().stats()["collectives_outside_comm"] == []


def test_the_check_bites(tmp_path):
    import ast

    tree = ast.parse("import torch.distributed as dist\ndef f(x, g):\n    dist.all_reduce(x, group=g)\n")
    assert _code_stats().collectives_outside_comm(tree) == [(3, "dist.all_reduce")]
