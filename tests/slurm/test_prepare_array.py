"""scripts/slurm/prepare.sbatch as a 4-task job array on the local cluster gives the one-task preparation
(the same num_documents, num_tokens and shard files)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.e2e.stdlib_corpus import write_corpus
from tests.slurm.helpers import ROOT, job_env, show, tail, wait_until

pytestmark = pytest.mark.slurm
ARGS = ["data.vocab_size=512"]


def test_prepare_array_equals_one_task(slurm_cluster, tmp_path):
    src = write_corpus(tmp_path / "src")
    one = subprocess.run(
        [
            sys.executable,
            "-m",
            "megaframe.data.prepare",
            f"data.source={src}",
            f"data.path={tmp_path / 'one'}",
            "data.num_workers=1",
            *ARGS,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr
    script = (
        tmp_path / "prepare.sbatch"
    )  # the shipped script less its CPU request (the local nodes are small)
    script.write_text(
        re.sub(
            r"^#SBATCH --cpus-per-task=.*$",
            "",
            (ROOT / "scripts/slurm/prepare.sbatch").read_text(),
            flags=re.M,
        )
    )
    res = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--array=0-3",
            "--time=15",
            str(script),
            f"data.source={src}",
            f"data.path={tmp_path / 'four'}",
            "data.num_tasks=4",
            "data.num_workers=1",
            *ARGS,
        ],
        cwd=tmp_path,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    job = int(res.stdout.strip().split(";")[0])
    out = tmp_path / f"megaframe-prepare-{job}_0.out"
    wait_until(lambda: (tmp_path / "four" / "meta.json").is_file(), 300, "the array's meta.json", job, out)
    wait_until(
        lambda: not show(job) or show(job).get("JobState") in {"COMPLETED", None},
        120,
        "the array's end",
        job,
        out,
    )
    a, b = (json.loads((tmp_path / d / "meta.json").read_text()) for d in ("one", "four"))
    assert (a["num_documents"], a["num_tokens"]) == (b["num_documents"], b["num_tokens"]), tail(out)
    assert [s["file"] for s in a["shards"]] == [s["file"] for s in b["shards"]]
    for s in a["shards"]:
        assert (tmp_path / "one" / s["file"]).read_bytes() == (tmp_path / "four" / s["file"]).read_bytes()
