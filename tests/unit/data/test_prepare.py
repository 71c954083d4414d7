"""megaframe.data.prepare: a tiny corpus in, token shards + document index + tokenizer + meta.json out,
the same stream whatever the worker count and chunking, and its failure modes.

Most cases call main() in-process (fast); the CLI contract (exit code 2, one stderr line) is checked
in a subprocess, as a user would run it.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from megaframe.config import load_config
from megaframe.data import prepare as prep
from megaframe.data.tokenizer import Tokenizer
from tests.e2e.helpers import run

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Emma Woodhouse, handsome, clever, and rich, had lived nearly twenty-one years in the world.",
    "It is a truth universally acknowledged that a single man must be in want of a wife!",
    "Alice was beginning to get very tired of sitting by her sister on the bank.",
    "Of Man's first disobedience, and the fruit of that forbidden tree;",
    "All the world's a stage, and all the men and women merely players.",
    "How vexingly quick daft zebras jump; the five boxing wizards jump quickly?",
    "In 1815 there were 3 carriages, 12 horses and 250 acres (or so they said).",
    '"Nonsense," said she, "you must not talk of such things" -- and then she laughed.',
    "Pack my box with five dozen liquor jugs: naïve café owners rarely agree.",
]


def paragraphs(n: int = 24) -> list[str]:
    """Deterministic varied paragraphs; a few span two lines and one holds the literal text '</s>'."""
    out = []
    for i in range(n):
        words = [SENTENCES[(i * 3 + k) % len(SENTENCES)] for k in range(1 + i % 4)]
        sep = "\n" if i % 5 == 0 else " "
        out.append(sep.join(words))
    out[3] += " A literal </s> is text, not an end of document."
    return out


def write_text_corpus(folder: Path, paras: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    half = len(paras) // 2
    (folder / "a.txt").write_text("\n\n".join(paras[:half]) + "\n")
    with gzip.open(folder / "b.txt.gz", "wt") as f:  # compressed files are read too, after a.txt
        f.write("\n\n\n".join(paras[half:]) + "\n\n")
    return folder


def run_main(capsys, *overrides: str) -> tuple[int, str, str]:
    # these corpora are paragraphs of prose and the tests count paragraph documents; the default
    # (data.split=file) has its own tests below
    if not any(o.startswith("data.split=") for o in overrides):
        overrides = (*overrides, "data.split=paragraph")
    rc = prep.main(list(overrides))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def read_tokens(out: Path) -> tuple[dict, np.ndarray]:
    meta = json.loads((out / "meta.json").read_text())
    arrays = [
        np.fromfile(out / s["file"], dtype="<" + np.dtype(meta["dtype"]).str[1:]) for s in meta["shards"]
    ]
    return meta, np.concatenate(arrays)


def split_docs(tokens: np.ndarray, eos: int) -> list[np.ndarray]:
    assert tokens[-1] == eos, "the stream must end with eos"
    cuts = np.nonzero(tokens == eos)[0]
    return np.split(tokens, cuts + 1)[:-1]


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory) -> Path:
    return write_text_corpus(tmp_path_factory.mktemp("corpus"), paragraphs())


def test_prepare_text_corpus(tmp_path, text_corpus, capsys):
    out = tmp_path / "nested" / "prepared"
    rc, stdout, err = run_main(
        capsys, f"data.source={text_corpus}", f"data.path={out}", "data.vocab_size=400"
    )
    assert rc == 0, err
    assert "prepared 24 documents" in stdout and str(out) in stdout
    meta, tokens = read_tokens(out)
    tok = Tokenizer.load(out / "tokenizer.model")
    assert meta["format"] == "megaframe-tokens-v2" and meta["dtype"] == "uint16"
    assert meta["vocab_size"] == tok.vocab_size <= 400 and meta["eos_id"] == tok.eos_id
    assert meta["num_documents"] == 24 and meta["num_tokens"] == tokens.size
    assert sum(s["num_tokens"] for s in meta["shards"]) == tokens.size
    assert meta["tokenizer"] == "tokenizer.model" and meta["source"] == str(text_corpus)
    assert meta["tokenizer_sha256"] == hashlib.sha256((out / "tokenizer.model").read_bytes()).hexdigest()
    assert tokens.max() < meta["vocab_size"]
    assert [r["rel"] for r in meta["sources"]] == ["a.txt", "b.txt.gz"]
    assert meta["sources"][0]["sha256"] == hashlib.sha256((text_corpus / "a.txt").read_bytes()).hexdigest()
    assert meta["settings"]["tokenizer"] == {"train_vocab_size": 400, "train_sample_bytes": 1 << 30}
    # the document index: each shard's document starts, and eos right before every one but the first
    starts = np.concatenate(
        [
            np.load(out / s["docs"]) + off
            for s, off in zip(meta["shards"], np.cumsum([0] + [s["num_tokens"] for s in meta["shards"]]))
        ]
    )
    assert len(starts) == 24 and starts[0] == 0 and (tokens[starts[1:] - 1] == tok.eos_id).all()
    # eos separates documents: one per paragraph, each decoding back to its text exactly
    docs = split_docs(tokens, tok.eos_id)
    assert len(docs) == 24
    assert tok.decode(docs[0][:-1]) == paragraphs()[0]
    assert [tok.decode(d[:-1]) for d in docs] == paragraphs()
    assert sorted(p.name for p in out.parent.iterdir()) == ["prepared"], "temp folder left behind"


def test_deterministic_whatever_the_workers_and_chunks(tmp_path, text_corpus, capsys):
    """One worker or two, one shard or many small ones (one unit per file): the same tokenizer and stream."""
    args = [f"data.source={text_corpus}", "data.vocab_size=400", "data.split=paragraph"]
    assert run_main(capsys, *args, "data.num_workers=1", f"data.path={tmp_path / 'a'}")[0] == 0
    cfg = load_config(
        [*args, "data.num_workers=2", f"data.path={tmp_path / 'b'}"], world_size=1, check_data=False
    )
    meta_b = prep.prepare(cfg, unit_bytes=1, chunk_chars=300)
    meta_a, tokens_a = read_tokens(tmp_path / "a")
    _, tokens_b = read_tokens(tmp_path / "b")
    assert meta_a["tokenizer_sha256"] == meta_b["tokenizer_sha256"]
    assert len(meta_a["shards"]) == 1 and len(meta_b["shards"]) > 4
    assert meta_b["shards"][-1]["file"].startswith("shard_00001_")  # unit 1 = the second file
    np.testing.assert_array_equal(tokens_a, tokens_b)
    assert meta_b["num_documents"] == sum(s["num_docs"] for s in meta_b["shards"]) == 24
    shard_b = (tmp_path / "b" / meta_b["shards"][0]["file"]).read_bytes()
    assert meta_b["shards"][0]["sha256"] == hashlib.sha256(shard_b).hexdigest()


def test_jsonl_and_parquet_source(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    paras = paragraphs(16)
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    with gzip.open(src / "a.jsonl.gz", "wt") as f:
        for i, p in enumerate(paras[:10]):
            f.write(json.dumps({"body": p, "id": i}) + "\n")
    (src / "b.jsonl").write_text(json.dumps({"body": "   "}) + "\n")  # a blank record is skipped
    pq.write_table(pa.table({"body": paras[10:], "id": list(range(6))}), src / "sub" / "c.parquet")
    (src / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))  # not a listed extension: skipped
    out = tmp_path / "out"
    rc, _, err = run_main(
        capsys, f"data.source={src}", f"data.path={out}", "data.vocab_size=400", "data.text_key=body"
    )
    assert rc == 0, err
    meta, tokens = read_tokens(out)
    tok = Tokenizer.load(out / "tokenizer.model")
    assert meta["num_documents"] == 16
    assert [tok.decode(d[:-1]) for d in split_docs(tokens, tok.eos_id)] == paras


def test_missing_source_cli(tmp_path):
    out = tmp_path / "out"
    proc = run(  # a fork of the warm interpreter: the subject is the exit code and its line
        [
            sys.executable,
            "-m",
            "megaframe.data.prepare",
            f"data.source={tmp_path / 'nope'}",
            f"data.path={out}",
        ],
        timeout=60,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megaframe: error: ") and "does not exist" in lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "setup, overrides, needle",
    [
        (
            lambda d: (d / "x.png").write_bytes(bytes(64)),
            ["data.vocab_size=400"],
            "no files ending in data.extensions",
        ),
        (lambda d: (d / "x.txt").write_text("\n\n   \n\n"), ["data.vocab_size=400"], "no text"),
        (lambda d: (d / "x.txt").write_text("hello"), ["data.vocab_size=100"], "too small"),
        (lambda d: (d / "x.txt").write_text("hello"), ["data.vocab_size=abc"], "data.vocab_size"),
        (
            lambda d: (d / "x.jsonl").write_text('{"text": "hi"}\n{"text": oops\n'),
            ["data.vocab_size=400"],
            "cannot read",
        ),
        (
            lambda d: (d / "x.jsonl").write_text('{"body": "hi"}\n'),
            ["data.vocab_size=400"],
            "no field 'text'",
        ),
        (
            lambda d: (d / "x.jsonl").write_text('{"text": ""}\n{"text": 3}\n'),
            ["data.vocab_size=400"],
            "no text",
        ),
        (
            lambda d: (d / "x.txt").write_bytes(np.random.default_rng(0).bytes(5000)),
            ["data.vocab_size=400"],
            "x.txt: binary",
        ),
        (
            lambda d: (d / "x.txt").write_text("ok text " * 50 + "\x01\x02\x03" * 30),
            ["data.vocab_size=400"],
            "binary",
        ),
        (
            lambda d: (d / "x.txt").write_text("hello"),
            ["data.tokenizer=/nonexistent/tok.model"],
            "data.tokenizer",
        ),
        (
            lambda d: (d / "x.txt").write_text("hello") and (d / "t.model").write_text("junk"),
            ["data.tokenizer=${data.source}/t.model"],
            "cannot load the tokenizer",
        ),
    ],
)
def test_bad_input_exits_2(tmp_path, capsys, setup, overrides, needle):
    src = tmp_path / "src"
    src.mkdir()
    setup(src)
    rc, stdout, err = run_main(
        capsys, f"data.source={src}", f"data.path={tmp_path / 'a' / 'out'}", *overrides
    )
    # stdout: at most the progress lines printed as each phase starts (skipped files, tokenizer training)
    assert rc == 2 and all(ln.startswith("megaframe: prepare: ") for ln in stdout.splitlines()), stdout
    assert len(err.strip().splitlines()) == 1 and err.startswith("megaframe: error: ") and needle in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"], "a failed run must write nothing"


def test_existing_prepared_folder_untouched(tmp_path, text_corpus, capsys):
    out = tmp_path / "out"
    assert run_main(capsys, f"data.source={text_corpus}", f"data.path={out}", "data.vocab_size=400")[0] == 0
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()}
    rc, stdout, _ = run_main(capsys, f"data.source={text_corpus}", f"data.path={out}", "data.vocab_size=400")
    assert rc == 0 and "already prepared" in stdout  # an identical re-run does nothing
    # a different source or vocabulary never rebuilds over existing data: exit 2, one line
    for args, needle in [
        ([f"data.source={tmp_path / 'nope'}"], "does not exist"),
        (["data.vocab_size=500"], "data.vocab_size=500"),
        (["data.text_key=body"], "data.text_key"),
    ]:
        over = [f"data.source={text_corpus}", f"data.path={out}", "data.vocab_size=400", *args]
        rc, stdout, err = run_main(capsys, *over)
        assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_non_empty_unprepared_path_refused(tmp_path, text_corpus, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, _, err = run_main(capsys, f"data.source={text_corpus}", f"data.path={out}")
    assert rc == 2 and "without meta.json" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_code_folder_is_one_document_per_file(tmp_path, capsys):
    """data.split=file (the default): a folder of .py files, one document each, blank lines kept inside;
    an extension-less text file (a Makefile) is sniffed in, a binary one and an unlisted extension skipped.
    Before: only .txt/.jsonl/.json/.parquet were read (this folder had no corpus files at all), and every
    blank-line paragraph of a .txt became its own document."""
    src = tmp_path / "repo"
    (src / "pkg").mkdir(parents=True)
    files = {
        "pkg/__init__.py": '"""A package."""\n\nVERSION = "1.0"\n',
        "pkg/core.py": "import os\n\n\ndef f(x):\n    return x + 1\n\n\nclass A:\n    pass\n",
        "setup.py": "from setuptools import setup\n\nsetup(name='pkg')\n",
        "Makefile": "all:\n\tpython setup.py build\n\ntest:\n\tpytest\n",
    }
    for rel, text in files.items():
        (src / rel).write_text(text)
    (src / "blob").write_bytes(bytes(range(256)) * 4)  # extension-less, binary: skipped
    (src / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    out = tmp_path / "out"
    rc, stdout, err = run_main(
        capsys, f"data.source={src}", f"data.path={out}", "data.vocab_size=300", "data.split=file"
    )
    assert rc == 0, err
    meta, tokens = read_tokens(out)
    assert sorted(r["rel"] for r in meta["sources"]) == sorted(files)
    assert meta["num_documents"] == 4 and meta["settings"]["split"] == "file"
    tok = Tokenizer.load(out / "tokenizer.model")
    order = sorted(files, key=lambda rel: str(src / rel))
    assert [tok.decode(d[:-1]) for d in split_docs(tokens, tok.eos_id)] == [files[r].strip() for r in order]
    # the same folder read as paragraphs is another preparation: refused over the first, never overwritten
    rc, _, err = run_main(
        capsys, f"data.source={src}", f"data.path={out}", "data.vocab_size=300", "data.split=paragraph"
    )
    assert rc == 2 and "data.split=paragraph" in err


def test_empty_files_are_counted_as_skipped_not_tokenized(tmp_path, capsys):
    """Empty files only: the skip line gives no data.extensions hint (no ending was skipped), and the
    tokenizing line counts the files that are tokenized, not the empty ones too."""
    src = tmp_path / "src"
    src.mkdir()
    for i, text in enumerate(paragraphs()[:3]):
        (src / f"doc{i}.txt").write_text(text * 20)
    for i in range(2):
        (src / f"empty{i}.txt").write_text("")
    rc, stdout, err = run_main(
        capsys,
        f"data.source={src}",
        f"data.path={tmp_path / 'out'}",
        "data.vocab_size=400",
        "data.num_workers=1",
    )
    assert rc == 0, err
    skipped = [ln for ln in (stdout + err).splitlines() if "skipped" in ln]
    assert skipped and "2 x empty" in skipped[0] and "data.extensions" not in skipped[0], skipped
    assert "tokenizing 3 files" in stdout, stdout


def test_raw_files_given_as_data_path_get_a_prepare_command_that_runs(tmp_path, text_corpus):
    """data.path at a folder of source files: the hint prepares it into a new folder (the old hint named the
    folder itself as data.path, which prepare refuses: a non-empty folder without meta.json)."""
    from megaframe.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(["data=demo", f"data.path={text_corpus}"], world_size=1)
    msg = str(e.value)
    assert f"data.source={text_corpus} data.path={text_corpus}-prepared" in msg, msg


def test_a_full_disk_while_tokenizing_is_exit_1_as_for_every_tool(tmp_path, text_corpus, capsys, monkeypatch):
    """docs/checkpoints.md: the tools on a full disk say it in one line and exit 1 (not bad input); a shard
    write refused inside the tokenizing loop once ended with exit 2."""
    import errno

    from megaframe.data import shards

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(shards, "write_atomic", full)
    out = tmp_path / "out"
    over = (f"data.source={text_corpus}", f"data.path={out}", "data.vocab_size=400", "data.num_workers=1")
    rc, _, err = run_main(capsys, *over)  # one worker: the shards are written in this process
    assert rc == 1 and err.count("\n") == 1 and "No space left on device" in err, err
    assert not out.exists()  # nothing published
