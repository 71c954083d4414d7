"""Pool functions for in-loop downstream scoring across ranks: the training loop's Downstream on a live model,
with a local task whose documents fail to load on some ranks only."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os

from megaframe.config import load_config
from megaframe.data.tokenizer import load_tokenizer
from tests.forms import build_model

FAILING = "MEGAFRAME_TEST_FAILING_RANKS"
"""The ranks (comma-separated, global) where the flaky task's documents cannot be loaded."""

FLAKY_PY = f'''
import os
from pathlib import Path


def load(**_kwargs):
    import datasets
    import torch.distributed as dist

    if str(dist.get_rank()) in os.environ.get("{FAILING}", "").split(","):
        raise ConnectionError("the hub cannot be reached from this node")
    docs = str(Path(__file__).with_name("tiny_mc.jsonl"))
    return datasets.load_dataset("json", data_files={{"test": docs}})
'''

FLAKY_YAML = """task: megaframe_tiny_flaky
custom_dataset: !function tiny_flaky.load
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""


def score_with_ranks_failing(mesh, overrides: list[str], tokenizer: str, include: str, failing: list[str]):
    """For each entry of `failing` (ranks whose flaky task fails to load), score [flaky, tiny_mc] once at
    step 1 with the loop's Downstream: [(its metrics row, what this rank wrote to stderr)]."""
    from megaframe.evaluation.downstream import Downstream

    cfg = load_config(overrides, world_size=mesh.world, check_data=False)
    model = build_model(cfg, mesh)
    t = dataclasses.replace(
        cfg.train,
        downstream_interval=1,
        downstream_tasks=["megaframe_tiny_flaky", "megaframe_tiny_mc"],
        downstream_include_path=include,
        downstream_batch_size=4,
        downstream_limit=4,
    )
    scorer = Downstream(t, mesh, load_tokenizer(tokenizer))
    out = []
    for ranks in failing:
        os.environ[FAILING] = ranks
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            row, _ = scorer.score(1, model)
        out.append((row, err.getvalue()))
    os.environ.pop(FAILING, None)
    return out
