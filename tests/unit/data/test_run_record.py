"""What a run trained on, recorded once in the checkpoint and used everywhere: export, generate and evaluate
take the recorded tokenizer (sha256-checked) and the run's own blend or stages, never the data= preset's
data.path; a resume refuses a changed mixture, split or dataset content unless allowed; the vocabulary of a
stages run comes from its first dataset. Real prepared folders (sentencepiece), real checkpoints, one
process."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from megaframe.checkpoint import sharded
from megaframe.config import ConfigError, load_config
from megaframe.config.schema import plain
from megaframe.data import prepare as prep
from megaframe.data.kinds import data_state, tokenizer_identity
from megaframe.parallel.mesh import single_process_mesh
from tests.forms import build_model
from tests.unit.data.test_prepare import paragraphs, write_text_corpus

ROOT = Path(__file__).resolve().parents[3]
TINY = [
    "model=gpt_tiny",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=96",
    "model.seq_length=16",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> Path:
    """a: 400 pieces; b: the same text under another tokenizer (380 pieces); c: other text under a's
    tokenizer."""
    root = tmp_path_factory.mktemp("record")
    text = paragraphs(40)
    src, other = write_text_corpus(root / "src", text), write_text_corpus(root / "src2", text[::-1][:25])
    for name, source, extra in (
        ("a", src, ["data.vocab_size=400"]),
        ("b", src, ["data.vocab_size=380"]),
        ("c", other, [f"data.tokenizer={root / 'a' / 'tokenizer.model'}"]),
    ):
        cfg = load_config(
            [f"data.source={source}", f"data.path={root / name}", "data.num_workers=1", *extra],
            world_size=1,
            check_data=False,
        )
        prep.prepare(cfg, chunk_chars=500)
    return root


def copy(corpora: Path, name: str, dst: Path) -> Path:
    shutil.copytree(corpora / name, dst)
    return dst


def blend(*pairs) -> str:
    return "[" + ", ".join(f"{{path: {p}, weight: {w}}}" for p, w in pairs) + "]"


def stages(first, rest) -> str:
    return f"data.stages=[{{until_step: 2, blend: {blend(*first)}}}, {{blend: {blend(*rest)}}}]"


class WeightsOnly:
    def logical_state(self, p) -> dict:
        return {}


def checkpoint(tmp: Path, overrides: list[str], preset_path: Path) -> tuple[Path, dict]:
    """A committed step_00000002 with the metadata the trainer writes (data state, tokenizer record, config),
    whose config's data.path is `preset_path`: the data= preset's folder, which a blend or stages run never
    reads."""
    cfg = load_config(
        ["data=demo", *TINY, f"run.dir={tmp / 'run'}", "checkpoint.resume=none", *overrides], world_size=1
    )
    config = plain(cfg)
    config["data"]["path"] = str(preset_path)
    data = data_state(cfg.data, 2, cfg.train.seed, cfg.train.global_batch_size)
    meta = {"consumed_samples": 8, "data": data, "tokenizer": tokenizer_identity(cfg.data), "config": config}
    mesh = single_process_mesh()
    step = sharded.save(tmp / "ckpt", 2, build_model(cfg, mesh), WeightsOnly(), mesh, meta)
    return step, sharded.read_metadata(step)


def export_hf():
    spec = importlib.util.spec_from_file_location("export_hf", ROOT / "scripts" / "export_hf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_export_ships_the_tokenizer_a_stages_run_trained_with(corpora, tmp_path):
    from transformers import AutoTokenizer

    step, _ = checkpoint(tmp_path, [stages([(corpora / "a", 1)], [(corpora / "a", 1)])], corpora / "b")
    assert export_hf().main([str(step), str(tmp_path / "hf")]) == 0
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert len(tok) == 400  # a's 400 pieces, not the preset data.path's 380


def test_generate_falls_back_only_to_a_tokenizer_of_the_recorded_sha256(corpora, tmp_path):
    from megaframe.inference.files import find_tokenizer

    a, a2 = copy(corpora, "a", tmp_path / "a"), copy(corpora, "a", tmp_path / "a2")
    step, meta = checkpoint(tmp_path, [stages([(a, 1)], [(a, 0.5), (a2, 0.5)])], corpora / "b")
    assert find_tokenizer(step, meta)[1] == a / "tokenizer.model"
    a.rename(tmp_path / "moved")  # the recorded tokenizer is gone: the run's other dataset has the same one
    assert find_tokenizer(step, meta)[1] == a2 / "tokenizer.model"
    shutil.copyfile(corpora / "b" / "tokenizer.model", a2 / "tokenizer.model")  # another vocabulary there
    with pytest.raises(ValueError, match="sha256"):
        find_tokenizer(step, meta)  # never the preset's data.path (b) or a tokenizer of another sha256


def test_export_refuses_a_tokenizer_of_another_sha256(corpora, tmp_path):
    a = copy(corpora, "a", tmp_path / "a")
    step, _ = checkpoint(tmp_path, [f"data.blend={blend((a, 1))}"], corpora / "b")
    shutil.copyfile(corpora / "b" / "tokenizer.model", a / "tokenizer.model")
    assert export_hf().main([str(step), str(tmp_path / "hf")]) == 2
    assert not (tmp_path / "hf").exists()


def test_evaluate_scores_the_runs_own_data_never_the_presets_path(corpora, tmp_path, capsys):
    from megaframe import evaluate

    a, c = corpora / "a", corpora / "c"
    step, meta = checkpoint(
        tmp_path, [stages([(a, 1)], [(a, 0.5), (c, 0.5)]), "data.valid_fraction=0.2"], corpora / "b"
    )
    cfg = evaluate.compose(str(step), step, meta, [])  # the preset's b (another tokenizer) was refused here
    assert [(b.path, b.weight) for b in cfg.data.blend] == [(str(a), 0.5), (str(c), 0.5)]
    assert cfg.data.valid_fraction == 0.2 and evaluate.trained_on(meta, cfg) is None
    assert evaluate.main([str(step), "1"]) == 0
    out = capsys.readouterr()
    assert f"on {a}+{c} [valid:" in out.out and str(corpora / "b") not in out.out + out.err
    # a blend run whose preset path has the same tokenizer: still the blend is scored, and named
    step2, meta2 = checkpoint(tmp_path / "blend", [f"data.blend={blend((c, 1))}"], a)
    assert evaluate.main([str(step2), "1"]) == 0
    out = capsys.readouterr()
    assert f"on {c} [all:" in out.out and "training samples" in out.err and f"{a} " not in out.out


def test_stages_infer_the_vocabulary_from_their_first_dataset(corpora):
    staged = load_config(
        ["data=demo", *TINY, stages([(corpora / "a", 1)], [(corpora / "c", 1)])],
        world_size=1,
        check_data=False,
    )
    blended = load_config(
        ["data=demo", *TINY, f"data.blend={blend((corpora / 'a', 1))}"], world_size=1, check_data=False
    )
    # 400 pieces padded to a multiple of 128, not the preset's demo vocabulary
    assert staged.model.vocab_size == blended.model.vocab_size == 512


def meta_of(cfg, step: int = 4) -> dict:
    """What the trainer records at `step` (the fields check_resume reads)."""
    consumed = step * cfg.train.global_batch_size
    return {
        "step": step,
        "consumed_samples": consumed,
        "config": plain(cfg),
        "data": data_state(cfg.data, step, cfg.train.seed, cfg.train.global_batch_size),
        "tokenizer": tokenizer_identity(cfg.data),
    }


def config(tmp_path, *overrides: str):
    return load_config(
        ["data=demo", *TINY, f"run.dir={tmp_path / 'run'}", *overrides], world_size=1, check_data=False
    )


def refused(cfg, meta, name: str) -> str:
    from megaframe.checkpoint.resume_checks import check_resume

    with pytest.raises(ConfigError) as info:
        check_resume(cfg, meta, "ckpt", verbose=True)
    msg = str(info.value)
    assert f"was written with {name}=" in msg and f"allow_config_change=[{name}]" in msg, msg
    assert "\n" not in msg
    return msg


def test_resume_refuses_changed_stages_blend_weights_and_valid_fraction(corpora, tmp_path, capsys):
    from megaframe.checkpoint.resume_checks import check_resume

    a, c = corpora / "a", corpora / "c"
    two = stages([(a, 1)], [(a, 0.5), (c, 0.5)])
    meta = meta_of(config(tmp_path, two))
    check_resume(config(tmp_path, stages([(f"{a}/", 1)], [(a, 0.5), (c, 0.5)])), meta, "ckpt", verbose=True)
    moved = two.replace("until_step: 2", "until_step: 1")
    assert "repeat" in refused(config(tmp_path, moved), meta, "data.stages")
    refused(config(tmp_path, f"data.blend={blend((a, 0.5), (c, 0.5))}"), meta, "data.stages")

    meta = meta_of(config(tmp_path, f"data.blend={blend((a, 0.5), (c, 0.5))}"))
    refused(config(tmp_path, f"data.blend={blend((a, 0.9), (c, 0.1))}"), meta, "data.blend")
    refused(config(tmp_path, f"data.blend={blend((c, 0.5), (a, 0.5))}"), meta, "data.blend")

    meta = meta_of(config(tmp_path, f"data.path={a}"))
    msg = refused(config(tmp_path, f"data.path={a}", "data.valid_fraction=0.1"), meta, "data.valid_fraction")
    assert "holds documents it trained on" in msg  # evaluate's wording
    # allowed: one warning line that says what changes, and the resume goes on
    capsys.readouterr()
    check_resume(
        config(
            tmp_path,
            f"data.path={a}",
            "data.valid_fraction=0.1",
            "checkpoint.allow_config_change=[data.valid_fraction]",
        ),
        meta,
        "ckpt",
        verbose=True,
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.valid_fraction changed from 0.0 to 0.1" in err[0], err
    assert "trained on" in err[0]
    check_resume(
        config(tmp_path, moved, "checkpoint.allow_config_change=[data]"),
        meta_of(config(tmp_path, two)),
        "ckpt",
        verbose=False,
    )


def test_resume_refuses_a_dataset_prepared_again_but_not_a_moved_copy(corpora, tmp_path):
    from megaframe.checkpoint.resume_checks import check_resume

    x = copy(corpora, "a", tmp_path / "x")
    meta = meta_of(config(tmp_path, f"data.path={x}"))
    moved = copy(corpora, "a", tmp_path / "moved")  # the same tokens elsewhere: the same data
    check_resume(config(tmp_path, f"data.path={moved}"), meta, "ckpt", verbose=False)
    refused(config(tmp_path, f"data.path={corpora / 'c'}"), meta, "data.path")  # other data
    shutil.rmtree(x)
    shutil.copytree(corpora / "c", x)  # prepared again in place, from other text
    assert "prepared again" in refused(config(tmp_path, f"data.path={x}"), meta, "data.path")


def test_resume_refuses_a_switch_between_prepared_and_synthetic_data(corpora, tmp_path):
    """Either way the stream the step's positions name is another one: refused unless allowed."""
    from megaframe.checkpoint.resume_checks import check_resume

    synth = ["data=synthetic", "model.vocab_size=512"]  # the prepared folders' model, other data
    prepared = meta_of(config(tmp_path, f"data.path={corpora / 'a'}"))
    assert "synthetic data from the same step" in refused(config(tmp_path, *synth), prepared, "data.kind")
    synthetic = meta_of(config(tmp_path, *synth))
    refused(config(tmp_path, f"data.path={corpora / 'a'}"), synthetic, "data.kind")
    check_resume(config(tmp_path, *synth), synthetic, "ckpt", verbose=False)  # nothing to compare
    allow = "checkpoint.allow_config_change=[data.kind]"
    check_resume(config(tmp_path, *synth, allow), prepared, "ckpt", verbose=False)


def test_a_checkpoint_recorded_before_sources_still_resumes_and_is_compared(corpora, tmp_path):
    """Today's checkpoints record the paths as typed and no content hash: compared resolved."""
    from megaframe.checkpoint.resume_checks import check_resume

    a, c = corpora / "a", corpora / "c"
    meta = meta_of(config(tmp_path, f"data.blend={blend((f'{a}/', 0.5), (c, 0.5))}"))
    for entry in meta["data"]["blend"]:
        entry["path"] += "/."
    meta["data"].pop("sources", None)
    check_resume(config(tmp_path, f"data.blend={blend((a, 0.5), (c, 0.5))}"), meta, "ckpt", verbose=False)
    refused(config(tmp_path, f"data.blend={blend((a, 0.6), (c, 0.4))}"), meta, "data.blend")
