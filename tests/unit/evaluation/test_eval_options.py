"""The lm-eval tools' options and model arguments: every number range-checked by the config's rules (one
line, exit 2, naming the option and the value typed), lm-eval's own `auto:N` batch size and a duplicate
batch_size taken, a bad checkpoint, a missing tokenizer or one of more ids than the model named in one line
by `python -m megaframe.evaluation` and `evaluate` (the hint naming the option that tool takes), and the
adapter registered without hiding lm-eval's own models. In-process; one tiny checkpoint."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is the optional extra .[eval] (make install adds it)")

from megaframe.checkpoint import sharded  # noqa: E402
from megaframe.config import load_config  # noqa: E402
from megaframe.parallel.mesh import single_process_mesh  # noqa: E402
from tests.e2e.helpers import run  # noqa: E402
from tests.forms import build_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
TASKS = str(ROOT / "tests" / "data" / "lm_eval_tasks")
TASK = "megaframe_tiny_mc"
TINY = [
    "data=synthetic",
    "model=gpt_tiny",
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.num_attention_heads=2",
    "model.ffn_hidden_size=64",
    "model.seq_length=64",
]


class WeightsOnly:
    def logical_state(self, p) -> dict:
        return {}


def _save(folder: Path, vocab: int, data_path: str | None) -> Path:
    cfg = load_config([*TINY, f"model.vocab_size={vocab}"], world_size=1, check_data=False)
    if data_path:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=data_path))
    model = build_model(cfg, single_process_mesh()).eval()
    meta = {"config": dataclasses.asdict(cfg)}
    sharded.save(folder, 1, model, WeightsOnly(), single_process_mesh(), meta)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """ok: a 384-id model whose data folder holds its 360-piece tokenizer; small: a 256-id model (the
    tokenizer has more ids than it); bare: a synthetic-data checkpoint with no tokenizer anywhere."""
    from megaframe.data.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("evalopts")
    text = [line.strip() for line in (Path(TASKS) / "tiny_mc.jsonl").read_text().splitlines()] * 20
    text += [f"def f{i}(a, b):\n    return a + {i}  # the capital of France is Paris" for i in range(200)]
    (d / "data").mkdir()
    train_tokenizer(text, 360, d / "data" / "tokenizer", num_threads=1)
    return {
        "ok": _save(d / "ok", 384, str(d / "data")),
        "small": _save(d / "small", 256, str(d / "data")),
        "bare": _save(d / "bare", 384, None),
        "tokenizer": d / "data" / "tokenizer.model",
    }


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("megaframe: error: "), err
    return err[0]


@pytest.mark.parametrize(
    "option,msg",
    [
        # a negative batch left requests unscored (wrong scores, exit 0); 0 divided by zero
        ("+batch_size=-1", "+batch_size=-1 must be an integer >= 1"),
        ("+batch_size=0", "+batch_size=0 must be an integer >= 1"),
        ("+limit=abc", "+limit=abc must be a finite number > 0 and < 1 or an integer >= 1"),
        ("+limit=-0.4", "+limit=-0.4 must be"),
        ("+limit=-1", "+limit=-1 must be"),
        ("+num_fewshot=-1", "+num_fewshot=-1 must be an integer >= 0"),
        ("+tasks=", "+tasks=: give a value"),
        ("+include_path=/nonexistent_dir", "+include_path=/nonexistent_dir: no such folder"),
    ],
)
def test_evaluate_task_options_out_of_range_are_one_line(runs, option, msg, capsys):
    from megaframe.evaluate import main

    tasks = [] if option.startswith("+tasks") else [f"+tasks={TASK}"]
    path = [] if "include_path" in option else [f"+include_path={TASKS}"]
    assert main([f"checkpoint={runs['ok']}", *tasks, *path, option]) == 2
    assert msg in one_error(capsys)


def test_evaluate_refuses_a_tokenizer_larger_than_the_model_and_names_its_own_option(runs, capsys):
    from megaframe.evaluate import main

    base = [f"+tasks={TASK}", f"+include_path={TASKS}"]
    assert main([str(runs["small"]), *base, f"+tokenizer={runs['tokenizer']}"]) == 2
    assert "has 360 tokens > model.vocab_size=256" in one_error(capsys)
    # no tokenizer: the hint names evaluate's +tokenizer=PATH, not generate's --tokenizer
    assert main([str(runs["bare"]), *base]) == 2
    line = one_error(capsys)
    assert "no tokenizer found" in line and "pass +tokenizer=PATH" in line and "--tokenizer" not in line


def test_evaluate_takes_both_argument_styles_alike(capsys):
    from megaframe.evaluate import main, split_args, task_options

    styles = [
        ["runs/x", "+tasks=a", "+batch_size=2", "+tokenizer=t.model", "parallel.tp=2"],
        ["checkpoint=runs/x", "+tasks=a", "+batch_size=2", "+tokenizer=t.model", "parallel.tp=2"],
        ["+tasks=a", "parallel.tp=2", "checkpoint=runs/x", "batch_size=2", "tokenizer=t.model"],
        ["runs/x", "--tasks", "a", "--batch_size=2", "--tokenizer", "t.model", "parallel.tp=2"],
    ]
    parsed = []
    for argv in styles:
        ckpt, over, every = split_args(argv)
        parsed.append((ckpt, every, *task_options(over)))
    assert all(
        p == ("runs/x", False, {"tasks": "a", "batch_size": 2, "tokenizer": "t.model"}, ["parallel.tp=2"])
        for p in parsed
    ), parsed
    assert split_args(["runs/x", "8", "--all"]) == ("runs/x", ["train.eval_iters=8"], True)
    with pytest.raises(ValueError, match="two checkpoints"):
        split_args(["runs/x", "checkpoint=runs/y"])
    with pytest.raises(ValueError, match="--temperature: not an option of evaluate"):
        split_args(["runs/x", "--temperature", "0"])
    # an lm-eval option without +tasks was silently ignored by the perplexity form
    assert main(["runs/x", "--batch_size", "4"]) == 2
    assert "+batch_size=4 is an lm-eval option: add +tasks=" in one_error(capsys)


def test_the_model_takes_lm_evals_auto_batch_sizes_and_refuses_bad_ones():
    from types import SimpleNamespace

    from megaframe.config import ConfigError
    from megaframe.evaluation.lm_eval_adapter import DEFAULT_BATCH, MegaframeLM

    model = SimpleNamespace(cfg=SimpleNamespace(seq_length=64))
    for given, want in (("auto", DEFAULT_BATCH), ("auto:4", DEFAULT_BATCH), ("3", 3), (5, 5)):
        assert MegaframeLM(model=model, batch_size=given).batch_size == want
    for bad in (-1, 0, "-2", "abc", "auto:x", 2.5, float("nan")):
        with pytest.raises(ConfigError, match=f"batch_size={bad} must be an integer >= 1, auto or auto:N"):
            MegaframeLM(model=model, batch_size=bad)
    with pytest.raises(ConfigError, match="max_length=0 must be an integer >= 1"):
        MegaframeLM(model=model, max_length=0)


def test_the_model_takes_a_batch_size_given_twice_when_they_agree():
    from types import SimpleNamespace

    from megaframe.evaluation.lm_eval_adapter import MegaframeLM, ModelArgumentError

    model = SimpleNamespace(cfg=SimpleNamespace(seq_length=64))
    # lm-eval's CLI always passes its --batch_size (default 1) beside the model_args
    lm = MegaframeLM.create_from_arg_obj({"model": model, "batch_size": 2}, {"batch_size": 1, "device": None})
    assert lm.batch_size == 2
    assert (
        MegaframeLM.create_from_arg_string("batch_size=4", {"batch_size": "4", "model": model}).batch_size
        == 4
    )
    with pytest.raises(ModelArgumentError, match="batch_size=2 and --batch_size 4 differ"):
        MegaframeLM.create_from_arg_obj({"model": model, "batch_size": 2}, {"batch_size": 4})
    with pytest.raises(ModelArgumentError, match="batch_size=-2 must be"):
        MegaframeLM.create_from_arg_obj({"model": model, "batch_size": -2}, {"batch_size": 1})


def lm_eval_cli(*args: str) -> int:
    from megaframe.evaluation.__main__ import main

    return main(["--model", "megaframe", "--tasks", TASK, "--include_path", TASKS, *args])


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--batch_size", "-1"], "--batch_size -1 must be an integer >= 1, auto or auto:N"),
        (["--batch_size", "auto:x"], "--batch_size auto:x must be"),
        (["--limit", "-1"], "--limit -1 must be a finite number > 0 and < 1 or an integer >= 1"),
        (["--num_fewshot", "-1"], "--num_fewshot -1 must be an integer >= 0"),
        (["--max_batch_size", "0"], "--max_batch_size 0 must be an integer >= 1"),
        (["--include_path", "/nonexistent_dir"], "--include_path /nonexistent_dir: no such folder"),
        (["--model_args", "checkpoint={ok},batch_size=0"], "batch_size=0 must be"),
        (["--model_args", "checkpoint={ok}", "--batch_size", "3", "-a", "max_length=0"], "max_length=0"),
        # named before lm-eval indexes its tasks, not after (lm-eval merges repeated --model_args)
        (
            ["--model_args", "checkpoint={ok}", "-a", "batch_size=2", "--batch_size", "3"],
            "batch_size=2 and --batch_size 3",
        ),
    ],
)
def test_lm_eval_command_line_numbers_are_one_line(runs, args, msg, capsys):
    args = [a.format(ok=runs["ok"]) for a in args]
    if not any(a.startswith("checkpoint=") for a in args):
        args += ["--model_args", f"checkpoint={runs['ok']}"]
    assert lm_eval_cli(*args) == 2
    assert msg in one_error(capsys)


def test_lm_eval_command_line_bad_model_arguments_are_one_line(runs, tmp_path, capsys):
    """A missing checkpoint, a checkpoint without a tokenizer, a tokenizer of more ids than the model:
    each named in one line (exit 2) before lm-eval indexes its tasks, the hint naming --model_args."""
    assert lm_eval_cli("--model_args", f"checkpoint={tmp_path / 'nonexistent'}") == 2
    assert "no such checkpoint" in one_error(capsys)
    assert lm_eval_cli("--model_args", f"checkpoint={runs['bare']}") == 2
    line = one_error(capsys)
    assert "no tokenizer found" in line and "--model_args checkpoint=PATH,tokenizer=PATH" in line
    assert lm_eval_cli("--model_args", f"checkpoint={runs['small']},tokenizer={runs['tokenizer']}") == 2
    assert "has 360 tokens > model.vocab_size=256" in one_error(capsys)


def test_a_construction_error_inside_lm_eval_is_one_line(runs, monkeypatch, capsys):
    """What the early check cannot see (the weights themselves) fails where lm-eval builds the model: still
    one line, not a traceback. lm-eval's CLI stands in by building the model as it does (its task
    indexing alone takes ~12 s)."""
    import lm_eval.__main__

    from megaframe.checkpoint import whole_load
    from megaframe.evaluation.lm_eval_adapter import MegaframeLM

    def build_as_lm_eval_does():
        MegaframeLM.create_from_arg_obj({"checkpoint": str(runs["ok"])}, {"batch_size": 1, "device": None})

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", build_as_lm_eval_does)
    monkeypatch.setattr(whole_load, "load_model", lambda step: (_ for _ in ()).throw(OSError("torn shard")))
    assert lm_eval_cli("--model_args", f"checkpoint={runs['ok']}") == 2
    assert "cannot load the model (torn shard)" in one_error(capsys)


def test_importing_the_adapter_keeps_lm_evals_own_models(tmp_path):
    """lm-eval fills its registry only while it is empty: after the adapter registered `megaframe` alone,
    `hf` was "no model for this name found". Another process: this one's registry is filled already. A fork
    of the suite's warm interpreter (tests/e2e/warm_start.py), which never imports lm-eval: its registry is
    as empty as a fresh interpreter's, without importing torch again."""
    script = tmp_path / "registry.py"
    script.write_text(
        "import megaframe.evaluation.lm_eval_adapter\n"
        "from lm_eval.api.registry import get_model\n"
        "print(get_model('hf').__name__, get_model('megaframe').__name__)\n"
    )
    res = run([sys.executable, str(script)], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["HFLM", "MegaframeLM"]


def test_a_missing_task_folder_is_named_where_tasks_are_scored():
    """The training loop's train.downstream_include_path reaches run_tasks directly."""
    from megaframe.evaluation.lm_tasks import run_tasks

    with pytest.raises(ValueError, match="include_path=/nonexistent_dir: no such folder"):
        run_tasks(None, [TASK], "/nonexistent_dir")
