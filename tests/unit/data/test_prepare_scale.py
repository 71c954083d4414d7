"""prepare at scale: resume after an interruption, the manifest refusing changed input, reused tokenizers
(sentencepiece file, transformers folder), sampled tokenizer training, and the lock."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megaframe.atomic_lock import SharedFlock
from megaframe.config import load_config
from megaframe.data import prepare as prep
from megaframe.data.prepare import unit_encoding
from megaframe.data.prepare.sources import resolve_source, sample_documents
from megaframe.data.tokenizer import load_tokenizer
from tests.unit.data.test_prepare import paragraphs, read_tokens, run_main, split_docs, write_text_corpus


@pytest.fixture()
def corpus(tmp_path):
    src = write_text_corpus(tmp_path / "src", paragraphs(30))
    (src / "c.txt").write_text("\n\n".join(paragraphs(40)[30:]) + "\n")
    return src


def snapshot(folder):
    """The folder's data files (a lock file names whoever held it last: not data)."""
    return {
        p.name: (p.stat().st_mtime_ns, p.stat().st_ino, p.read_bytes())
        for p in folder.iterdir()
        if p.is_file() and p.name != ".lock"
    }


def cfg_for(src, out, *extra):
    return load_config(
        [
            f"data.source={src}",
            f"data.path={out}",
            "data.vocab_size=400",
            "data.num_workers=1",
            "data.split=paragraph",
            *extra,
        ],
        world_size=1,
        check_data=False,
    )


def test_interrupted_run_resumes_skipping_finished_units(tmp_path, corpus, monkeypatch):
    out = tmp_path / "out"
    real = unit_encoding._finish_unit
    calls = []

    def finish_then_die(work, k, record):
        real(work, k, record)
        calls.append(k)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed after two of three units

    monkeypatch.setattr(unit_encoding, "_finish_unit", finish_then_die)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(cfg_for(corpus, out), unit_bytes=1)  # one unit per file
    work = tmp_path / ".out.partial"
    assert not out.exists() and (work / "units" / "unit_00001.json").is_file()
    done = {n: v for n, v in snapshot(work).items() if n.startswith(("shard_00000_", "shard_00001_"))}
    assert done
    monkeypatch.setattr(
        unit_encoding, "_finish_unit", lambda work, k, record: (calls.append(k), real(work, k, record))
    )
    meta = prep.prepare(cfg_for(corpus, out), unit_bytes=1)
    assert calls[2:] == [2], "only the unfinished unit is redone"
    after = snapshot(out)
    assert all(after[n] == v for n, v in done.items()), "finished shards were rewritten"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    assert not (out / "units").exists() and not (out / ".lock").exists()
    fresh = prep.prepare(cfg_for(corpus, tmp_path / "fresh"), unit_bytes=1)
    np.testing.assert_array_equal(read_tokens(out)[1], read_tokens(tmp_path / "fresh")[1])
    assert meta["tokenizer_sha256"] == fresh["tokenizer_sha256"] and meta["num_documents"] == 40


def test_partial_work_from_other_settings_is_refused(tmp_path, corpus, monkeypatch, capsys):
    def die(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(unit_encoding, "_finish_unit", die)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(cfg_for(corpus, tmp_path / "out"))
    monkeypatch.undo()
    work = tmp_path / ".out.partial"
    before = snapshot(work)
    rc, _, err = run_main(
        capsys, f"data.source={corpus}", f"data.path={tmp_path / 'out'}", "data.vocab_size=500"
    )
    assert rc == 2 and "unfinished preparation" in err and "data.vocab_size=500" in err, err
    assert snapshot(work) == before


def test_changed_source_is_detected_touch_is_not(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    args = [f"data.source={corpus}", f"data.path={out}", "data.vocab_size=400"]
    assert run_main(capsys, *args)[0] == 0
    before = snapshot(out)
    st = (corpus / "a.txt").stat()
    os.utime(corpus / "a.txt", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes, new mtime
    rc, stdout, _ = run_main(capsys, *args)
    assert rc == 0 and "already prepared" in stdout
    text = (corpus / "a.txt").read_text()
    (corpus / "a.txt").write_text(text.replace("fox", "cat"))  # same size, other content
    rc, _, err = run_main(capsys, *args)
    assert rc == 2 and "source file a.txt changed" in err and "refusing to overwrite" in err
    (corpus / "a.txt").write_text(text)
    (corpus / "d.txt").write_text("a new file")
    rc, _, err = run_main(capsys, *args)
    assert rc == 2 and "d.txt is new" in err
    assert snapshot(out) == before


def test_reuse_a_sentencepiece_model(tmp_path, corpus, capsys):
    assert (
        run_main(capsys, f"data.source={corpus}", f"data.path={tmp_path / 'a'}", "data.vocab_size=400")[0]
        == 0
    )
    tok = tmp_path / "a" / "tokenizer.model"
    args = [f"data.source={corpus}", f"data.path={tmp_path / 'b'}", f"data.tokenizer={tok}"]
    assert run_main(capsys, *args)[0] == 0
    meta_a, tokens_a = read_tokens(tmp_path / "a")
    meta_b, tokens_b = read_tokens(tmp_path / "b")
    assert (
        meta_b["tokenizer_sha256"] == meta_a["tokenizer_sha256"]
        and "given_sha256" in meta_b["settings"]["tokenizer"]
    )
    np.testing.assert_array_equal(tokens_a, tokens_b)
    # a re-run with another tokenizer file content is refused
    other = tmp_path / "other.model"
    other.write_bytes(tok.read_bytes() + b"\0")
    rc, _, err = run_main(
        capsys, f"data.source={corpus}", f"data.path={tmp_path / 'b'}", f"data.tokenizer={other}"
    )
    assert rc == 2 and "not the tokenizer it was made with" in err


def make_hf_tokenizer(folder, texts, eos: bool = True):
    """A transformers tokenizer folder built locally (no hub): byte-level BPE from `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=350,
        special_tokens=["<unk>", "</s>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", **({"eos_token": "</s>"} if eos else {})
    ).save_pretrained(str(folder))
    return folder


def test_transformers_tokenizer_folder(tmp_path, corpus, capsys):
    hf = make_hf_tokenizer(tmp_path / "hf", paragraphs(30))
    out = tmp_path / "out"
    rc, _, err = run_main(
        capsys, f"data.source={corpus}", f"data.path={out}", f"data.tokenizer={hf}", "data.num_workers=2"
    )
    assert rc == 0, err
    meta, tokens = read_tokens(out)
    assert meta["tokenizer"] == "tokenizer" and meta["tokenizer_kind"] == "transformers"
    tok = load_tokenizer(out / "tokenizer")
    assert meta["eos_id"] == tok.eos_id == 1 and meta["vocab_size"] == tok.vocab_size
    docs = [tok.decode(d[:-1]) for d in split_docs(tokens, tok.eos_id)]
    assert docs == paragraphs(40)  # a literal "</s>" in paragraph 3 stays text
    cfg = load_config(
        [f"data.path={out}", "model.vocab_size=512"], world_size=1
    )  # the train-time check passes
    assert cfg.data.path == str(out)
    no_eos = make_hf_tokenizer(tmp_path / "hf2", paragraphs(30), eos=False)
    rc, _, err = run_main(
        capsys, f"data.source={corpus}", f"data.path={tmp_path / 'o2'}", f"data.tokenizer={no_eos}"
    )
    assert rc == 2 and "no eos token" in err and not (tmp_path / "o2").exists()


def test_tokenizer_sample_spreads_over_the_corpus(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"f{i:02d}.txt").write_text(
            "\n\n".join(f"file {i} paragraph {j} " + "x" * 80 for j in range(20))
        )
    files = resolve_source(str(src))
    with mf_cache(tmp_path) as cache:
        everything = list(sample_documents(files, "text", cache, 0))
        sample = list(sample_documents(files, "text", cache, 8000))  # a tenth of the corpus
    assert len(everything) == 800
    assert 7000 <= sum(map(len, sample)) <= 10000
    picked = sorted({int(d.split()[1]) for d in sample})
    assert len(picked) == 16 and picked[0] == 0 and picked[-1] >= 37  # 16 files spread over all 40


def mf_cache(tmp_path):
    import contextlib

    from megaframe.data.prepare.sources import offline_hf

    @contextlib.contextmanager
    def ctx():
        cache = str(tmp_path / "hf-cache")
        with offline_hf(cache):
            yield cache

    return ctx()


def test_sampled_tokenizer_settings_are_recorded(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    args = [f"data.source={corpus}", f"data.path={out}", "data.vocab_size=400"]
    assert run_main(capsys, *args, "data.tokenizer_sample_bytes=2000")[0] == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["settings"]["tokenizer"]["train_sample_bytes"] == 2000
    rc, _, err = run_main(capsys, *args)  # the default sample size is another tokenizer
    assert rc == 2 and "data.tokenizer_sample_bytes" in err


def test_a_second_prepare_of_the_same_path_is_refused_while_locked(tmp_path, corpus, capsys):
    work = tmp_path / ".out.partial"
    work.mkdir()
    lock = SharedFlock(work / ".lock")
    try:
        rc, _, err = run_main(
            capsys, f"data.source={corpus}", f"data.path={tmp_path / 'out'}", "data.vocab_size=400"
        )
    finally:
        lock.release()
    assert rc == 2 and "another process" in err and not (tmp_path / "out").exists()
