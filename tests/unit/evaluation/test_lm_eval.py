"""lm-evaluation-harness over megaframe: the `megaframe` model scores the local multiple-choice task
(tests/data/lm_eval_tasks, no network) exactly as lm-eval's own `hf` model scores the exported folder with
the same tokenizer; rolling log-likelihoods and greedy generation run; unknown tasks and bad checkpoints
exit 2 with one line. One process; the training layouts are
tests/distributed/evaluation/test_lm_eval_layouts.py."""

from __future__ import annotations

import dataclasses
import subprocess
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
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=96",
    "model.seq_length=64",
    "model.vocab_size=384",
    "model.init_std=0.1",
]


class WeightsOnly:
    def logical_state(self, p) -> dict:
        return {}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A committed tiny Llama checkpoint whose data.path
    holds its sentencepiece tokenizer, and its HF export."""
    from megaframe.data.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("lmeval")
    text = [line.strip() for line in (Path(TASKS) / "tiny_mc.jsonl").read_text().splitlines()] * 20
    text += [f"def f{i}(a, b):\n    return a + {i}  # the capital of France is Paris" for i in range(200)]
    (d / "data").mkdir()
    train_tokenizer(text, 360, d / "data" / "tokenizer", num_threads=1)
    cfg = load_config(TINY, world_size=1, check_data=False)
    model = build_model(cfg, single_process_mesh()).eval()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(d / "data")))  # frozen config
    sharded.save(
        d / "ckpt", 3, model, WeightsOnly(), single_process_mesh(), {"config": dataclasses.asdict(cfg)}
    )
    res = run([sys.executable, "scripts/export_hf.py", str(d / "ckpt"), str(d / "hf")], timeout=300)
    assert res.returncode == 0, res.stderr
    return d


def per_choice(lm, limit=None) -> tuple[list[list[float]], float]:
    """Every choice's log-likelihood of the local task, in document order, and the accuracy."""
    from lm_eval import simple_evaluate

    from megaframe.evaluation.lm_tasks import task_manager

    out = simple_evaluate(
        model=lm,
        tasks=[TASK],
        task_manager=task_manager([TASK], TASKS),
        limit=limit,
        log_samples=True,
        bootstrap_iters=0,
    )
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return [[float(r[0]) for r in s["filtered_resps"]] for s in samples], out["results"][TASK]["acc,none"]


def worst_gap(a: list[list[float]], b: list[list[float]]) -> float:
    """Largest gap between two tables of log-likelihoods, relative to the value's size: sums near -50 of fp32
    log-probabilities are only held to 3.8e-6 (one fp32 ulp there), so 1e-6 is a relative bound."""
    return max(abs(x - y) / max(1.0, abs(y)) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_local_task_scores_like_lm_evals_hf_model(run_dir):
    from lm_eval.models.huggingface import HFLM

    from megaframe.evaluation.lm_eval_adapter import MegaframeLM

    hf = str(run_dir / "hf")
    ours, acc = per_choice(MegaframeLM(checkpoint=str(run_dir / "ckpt"), tokenizer=hf, batch_size=4))
    theirs, acc_hf = per_choice(
        HFLM(pretrained=hf, tokenizer=hf, dtype="float32", device="cpu", batch_size=4)
    )
    assert len(ours) == 12 and all(len(row) == 4 for row in ours)
    assert acc == acc_hf
    assert worst_gap(ours, theirs) <= 1e-6, (ours[:2], theirs[:2])
    # the run's own sentencepiece tokenizer (the default) encodes exactly like the exported one
    default, _ = per_choice(MegaframeLM(checkpoint=str(run_dir / "ckpt" / "step_00000003")))
    assert worst_gap(default, ours) <= 1e-6


def test_rolling_and_generate_until(run_dir):
    from lm_eval.api.instance import Instance

    from megaframe.evaluation.lm_eval_adapter import MegaframeLM

    lm = MegaframeLM(checkpoint=str(run_dir / "ckpt"), batch_size=2)
    text = "def f(a, b):\n    return a + b  # " * 12  # longer than seq_length: several windows
    [rolling] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    ctx = lm.tok_encode(text)
    # the same windows scored one by one through loglikelihood: the sum of their parts
    windows = [(None, lm.tok_encode(text)[:0] + [lm.eot_token_id], ctx[: lm.max_length])]
    assert rolling < 0 and rolling < lm._loglikelihood_tokens(windows)[0][0]
    reqs = [
        Instance("generate_until", {}, (p, {"until": ["\n"], "max_gen_toks": 6}), i)
        for i, p in enumerate(["def f(a, b):", "The capital of France is", "x"])
    ]
    texts = lm.generate_until(reqs)
    assert len(texts) == 3 and all("\n" not in t for t in texts)


def cli(*args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "megaframe.evaluate", *args], timeout=300, HF_HUB_OFFLINE="1")


def test_evaluate_cli_runs_tasks_and_refuses_bad_input(run_dir):
    res = cli(f"checkpoint={run_dir / 'ckpt'}", f"+tasks={TASK}", f"+include_path={TASKS}")
    assert res.returncode == 0, res.stderr
    assert f"{TASK} acc " in res.stdout and "acc_norm" in res.stdout
    bad = cli(f"checkpoint={run_dir / 'ckpt'}", "+tasks=no_such_task_here", f"+include_path={TASKS}")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no_such_task_here" in bad.stderr, (
        bad.stderr
    )
    gone = cli(f"checkpoint={run_dir / 'missing'}", f"+tasks={TASK}")
    assert gone.returncode == 2 and gone.stderr.count("\n") == 1, gone.stderr
    # a hub task without the hub (HF_HUB_OFFLINE=1, its data never cached here): one line naming the task
    hub = cli(str(run_dir / "ckpt"), "+tasks=arc_easy", "+limit=2")
    assert hub.returncode == 2 and hub.stderr.count("\n") == 1 and "arc_easy" in hub.stderr, hub.stderr[
        -2000:
    ]


def test_lm_evals_own_command_line_runs_the_megaframe_model(run_dir):
    """lm-eval's CLI (through megaframe's entry point, which registers the model) on a checkpoint folder (its
    latest step), as docs/after-training.md shows it."""
    res = run(
        [
            sys.executable,
            "-m",
            "megaframe.evaluation",
            "--model",
            "megaframe",
            "--model_args",
            f"checkpoint={run_dir / 'ckpt'}",
            "--batch_size",
            "4",
            "--tasks",
            TASK,
            "--include_path",
            TASKS,
        ],
        timeout=300,
        HF_HUB_OFFLINE="1",
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert TASK in res.stdout and "acc" in res.stdout
