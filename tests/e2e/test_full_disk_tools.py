"""The tools that write files (export_hf, import_hf, prepare, plot) on a full disk or past the file-size
limit, on real size-limited file systems (a tmpfs mount, RLIMIT_FSIZE): one `megaframe: error:` line
naming what could not be written, exit 1, no traceback, and no half-written output left where a reader
would take it."""

from __future__ import annotations

import contextlib
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e import helpers
from tests.e2e.helpers import ROOT, TINY, env

pytestmark = pytest.mark.e2e


@contextlib.contextmanager
def tmpfs(where: Path, size: str, fill: int = 0):
    where.mkdir(parents=True, exist_ok=True)
    got = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
    )
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({got.stderr.strip() or got.returncode})")
    try:
        if fill:
            (where / "filler").write_bytes(b"\0" * fill)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def run(args: list[str], fsize: int | None = None) -> subprocess.CompletedProcess:
    """`python ARGS` as a fork of the warm interpreter (helpers.run): the tools' writes are the subject, not
    the interpreter's start. Under a file-size limit a fresh interpreter: the limit is set in the child
    before it starts, which a fork of the server cannot get."""
    if fsize is None:
        return helpers.run([sys.executable, *args], timeout=300)

    def limit():  # in the child only
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,
    )


def assert_one_line(res, *words: str) -> None:
    out = res.stdout + res.stderr
    assert "Traceback" not in out, out[-3000:]
    assert res.returncode == 1, out[-3000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("megaframe: error:")]
    assert len(errors) == 1 and all(w in errors[0] for w in words), out[-3000:]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A one-step run (its checkpoint and metrics) and its HF export."""
    base = tmp_path_factory.mktemp("full_disk_tools")
    res = run(
        [
            "train.py",
            "data=synthetic",
            *TINY,
            "train.max_steps=1",
            "checkpoint.interval=1",
            f"run.dir={base / 'run'}",
        ]
    )
    assert res.returncode == 0, res.stderr[-3000:]
    res = run(["scripts/export_hf.py", str(base / "run" / "checkpoints"), str(base / "hf")])
    assert res.returncode == 0, res.stderr[-3000:]
    return base


def test_export_onto_a_full_tmpfs_is_one_line_and_leaves_no_folder(trained, tmp_path):
    with tmpfs(tmp_path / "mnt", "1m") as mnt:  # the export's safetensors alone is ~7 MB
        res = run(["scripts/export_hf.py", str(trained / "run" / "checkpoints"), str(mnt / "hf")])
        assert_one_line(res, f"OUT={mnt / 'hf'}", "No space left on device")
        assert sorted(p.name for p in mnt.iterdir()) == []


def test_import_onto_a_full_tmpfs_is_one_line_and_commits_nothing(trained, tmp_path):
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        res = run(["scripts/import_hf.py", str(trained / "hf"), str(mnt / "ck"), "data=synthetic"])
        assert_one_line(res, "not committed")
        assert not (mnt / "ck" / "step_00000000").exists() and not (mnt / "ck" / "latest").exists()


def test_plot_onto_a_full_tmpfs_is_one_line(trained, tmp_path):
    with tmpfs(tmp_path / "mnt", "64k", fill=64 << 10) as mnt:
        res = run(["-m", "megaframe.plot", str(trained / "run"), "--out", str(mnt / "loss.png")])
        assert_one_line(res, f"--out {mnt / 'loss.png'}")


def test_prepare_past_the_file_size_limit_is_one_line_and_publishes_nothing(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("".join(f"line {i} of a small corpus for the limit\n" for i in range(4000)))
    out = tmp_path / "out"
    tok = ROOT / "data" / "demo" / "prepared" / "tokenizer.model"
    if not tok.is_file():
        pytest.skip("the demo data is not prepared")
    # 32 KiB: less than the tokenizer model the prepare copies into its partial folder
    res = run(
        [
            "-m",
            "megaframe.data.prepare",
            f"data.source={src}",
            f"data.path={out}",
            f"data.tokenizer={tok}",
            "data.num_workers=1",
        ],
        fsize=32 << 10,
    )
    assert_one_line(res, str(out), "File too large")
    assert not out.exists()
