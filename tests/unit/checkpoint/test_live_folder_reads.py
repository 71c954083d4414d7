"""Tools reading a live run's checkpoint dir (load_model, generate, evaluate's model, the lm-eval model,
export_hf, checkpoint verify): when the run saves a newer step and prunes the one being read
(checkpoint.keep_last), the tool reads the new `latest` with a warning; a step folder named itself and
deleted, or a run that outpaces every try, is one line saying a live run pruned it; any other read error
is raised as before. The run is simulated in-process: the hooked read saves the next step with
keep_last=1 (the real save and prune) before it reads, so the timing is fixed, not raced."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from megaframe.checkpoint import sharded
from megaframe.checkpoint.metadata import CheckpointError
from megaframe.config import load_config
from megaframe.parallel.mesh import single_process_mesh
from tests.forms import build_model
from tests.unit.hf_scripts import export_hf

TINY = [
    "data=synthetic",
    "model=gpt_tiny",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=96",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.seq_length=32",
    "model.vocab_size=384",
]


class WeightsOnly:
    def logical_state(self, p) -> dict:
        return {}


def lineage(step: int) -> dict:
    """A run's checkpoint at `step`, continuing its previous step (what keep_last prunes along)."""
    return {"lineage": {"id": f"run:{step}", "run_id": "run", "parent": f"step_{step - 1:08d}"}}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A checkpoint dir at step 3 of a tiny Llama whose data.path holds its tokenizer (copied per test)."""
    from megaframe.data.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("live")
    (d / "data").mkdir()
    text = [f"Line {i}: the quick brown fox jumps over {i * 7} lazy dogs." for i in range(200)]
    train_tokenizer(text, 360, d / "data" / "tokenizer", num_threads=1)
    cfg = load_config(TINY, world_size=1, check_data=False)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(d / "data")))
    model = build_model(cfg, single_process_mesh()).eval()
    meta = {"config": dataclasses.asdict(cfg)}
    sharded.save(d / "ckpt", 3, model, WeightsOnly(), single_process_mesh(), {**meta, **lineage(3)})
    return d, model, meta


@pytest.fixture()
def run(base, tmp_path):
    """(checkpoint dir, live(module, name, every)): live hooks module.name so that its first call (every
    call with every=True) first saves the next step with keep_last=1, pruning the step being read."""
    d, model, meta = base
    root = tmp_path / "ckpt"
    shutil.copytree(d / "ckpt", root)
    step = [3]

    def live(monkeypatch, module, name, every=False):
        real = getattr(module, name)

        def hooked(*a, **kw):
            if every or step[0] == 3:
                step[0] += 1
                # the run's next save: committed, `latest` moved, its parent (the step being read) pruned
                new = {**meta, **lineage(step[0])}
                sharded.save(root, step[0], model, WeightsOnly(), single_process_mesh(), new, keep_last=1)
            return real(*a, **kw)

        monkeypatch.setattr(module, name, hooked)

    return root, live


def test_load_model_reads_the_new_latest(run, monkeypatch, capsys):
    import megaframe

    root, live = run
    live(monkeypatch, sharded, "load_into")
    assert megaframe.load_model(str(root)) is not None
    err = capsys.readouterr().err
    assert not (root / "step_00000003").exists()
    assert "step_00000003 was pruned by a live run while it was read" in err and "step_00000004" in err


def test_generate_reads_the_new_latest(run, monkeypatch):
    from megaframe.generate import load

    root, live = run
    live(monkeypatch, sharded, "load_into")
    assert load(str(root), "cpu", "fp32")[3].name == "step_00000004"


def test_the_lm_eval_model_reads_the_new_latest(run, monkeypatch):
    from megaframe.evaluation.lm_eval_adapter import load_checkpoint

    root, live = run
    live(monkeypatch, sharded, "load_into")
    model, _, tok = load_checkpoint(str(root), None)
    assert model is not None and tok.vocab_size <= 384


def test_export_reads_the_new_latest(run, monkeypatch, tmp_path, capsys):
    root, live = run
    live(monkeypatch, sharded, "load_full")
    assert export_hf.main([str(root), str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "step_00000004 (step 4" in out and (tmp_path / "hf" / "config.json").is_file()


def test_a_step_folder_named_itself_and_pruned_says_so(run, monkeypatch):
    import megaframe

    root, live = run
    live(monkeypatch, sharded, "load_into")
    with pytest.raises(CheckpointError, match="step_00000003: deleted while it was read .*keep_last"):
        megaframe.load_model(str(root / "step_00000003"))


def test_a_run_outpacing_every_try_is_one_line(run, monkeypatch, tmp_path, capsys):
    root, live = run
    live(monkeypatch, sharded, "load_full", every=True)
    assert export_hf.main([str(root), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("megaframe: error:") and "pruned by a live run while it was read, 3 times" in err


def test_a_read_error_of_a_step_still_there_is_not_retried(run, monkeypatch):
    from megaframe.generate import load

    root, _ = run
    meta = json.loads((root / "step_00000003" / "metadata.json").read_text())
    shard = next(iter(meta["files"]))
    (root / "step_00000003" / shard).unlink()  # damaged by hand: nobody saved a newer step
    with pytest.raises(ValueError, match="step_00000003"):
        load(str(root), "cpu", "fp32")


def test_checkpoint_verify_skips_a_step_pruned_while_verified(run, monkeypatch, capsys):
    from megaframe.checkpoint.__main__ import main

    root, live = run
    live(monkeypatch, sharded, "verify")
    assert main(["verify", str(root)]) == 0
    out = capsys.readouterr().out
    assert "skipped: " in out and "step_00000003 (pruned by a live run" in out


def test_evaluate_reads_the_new_latest(run, monkeypatch, capsys):
    from megaframe.evaluate import main

    root, live = run
    live(monkeypatch, sharded, "load_into")
    assert main([str(root), "1", "data=synthetic"]) == 0, capsys.readouterr().err
    assert "step_00000004 (step 4)" in capsys.readouterr().out
