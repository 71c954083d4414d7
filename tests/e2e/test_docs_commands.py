"""Every shell command of README.md and docs/ is checked: each page's commands run in order in a scratch
copy of the checkout (a user's journey through the page, with a tiny model and a few steps appended to
train commands), and the ones a CPU box cannot run (tagged [gpu], [cluster], [slow]) or that a named test
already runs ([tested-by: ...]) are checked for syntax: bash -n, and their Hydra overrides parsed and
checked against the schema. See tests/e2e/docs_commands.py for how a command is read, docs/README.md
for the tags."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megaframe.config.keys import PLANNER_KEYS
from megaframe.evaluate import TASK_KEYS
from tests.e2e import warm_start
from tests.e2e.docs_commands import PAGES, ROOT, commands, hydra_overrides, small_overrides
from tests.e2e.helpers import env, warm_server

pytestmark = pytest.mark.e2e
TIMEOUT_S = 240
# evaluate's own settings (lm-eval tasks, checkpoint=CKPT), removed before the schema check like the planner's
EVALUATE_KEYS = (*TASK_KEYS, "checkpoint")


def test_every_page_has_commands_and_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail into docs/"
    assert sum(len(commands(p)) for p in PAGES) >= 40
    assert [c.code for c in commands("README.md")[:2]] == ["make train", "make test"]  # DESIGN 1.1


@pytest.mark.parametrize("page", PAGES)
def test_syntax_and_config_keys(page):
    """bash -n over every block, each tested-by names a test that exists, and each command's Hydra
    overrides are keys of the schema (a renamed or deleted key fails here even where nothing runs)."""
    from megaframe.config.keys import check_override_keys
    from megaframe.errors import ConfigError

    cmds = commands(page)
    script = "\n".join(c.code for c in cmds)
    res = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, f"{page}: {res.stderr}"
    for c in cmds:
        if c.tested_by:
            path, _, name = c.tested_by.partition("::")
            assert (ROOT / path).is_file(), f"{c.where}: tested-by names a missing file {path}"
            if path.endswith(".md"):  # the same command runs on that page (README.md's tour runs first)
                assert c.code in [o.code for o in commands(path) if o.runs], (
                    f"{c.where}: {path} does not run it"
                )
                continue
            assert not name or f"def {name}(" in (ROOT / path).read_text(), (
                f"{c.where}: no test {c.tested_by}"
            )
        if c.expected_exit:  # a refusal the page shows on purpose: the run checks it
            continue
        tool, over = hydra_overrides(c)
        own = PLANNER_KEYS + (EVALUATE_KEYS if tool == "megaframe.evaluate" else ())
        over = [o for o in over if o.lstrip("+").split("=", 1)[0] not in own]
        try:
            check_override_keys(over)
        except ConfigError as e:
            pytest.fail(f"{c.where}: `{c.code}`: {e}")


def scratch_checkout(root: Path) -> Path:
    """A folder that looks like the checkout (its files linked) but keeps what the commands write: outputs/,
    runs/, data/<new corpus>. data/demo is linked, so the demo corpus prepared in the checkout is read."""
    work = root / "checkout"
    (work / "data").mkdir(parents=True)
    for p in ROOT.iterdir():
        if p.name not in {"data", "outputs", "runs", ".git", ".venv", ".pytest_cache"}:
            (work / p.name).symlink_to(p)
    for p in (ROOT / "data").iterdir():
        (work / "data" / p.name).symlink_to(p)
    (work / ".venv").symlink_to(Path(sys.prefix))
    return work


def _children_cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


class Journey:
    """One scratch checkout for every page: README.md's tour runs first (once, whichever page asks), then
    each page in it, so a page may build on what the tour wrote (runs/a, data/code) as its reader has."""

    def __init__(self, root: Path):
        self.work = scratch_checkout(root)
        bin_dir = str(Path(sys.executable).parent)
        server = warm_server()
        if server is not None:  # `python train.py` and `python -m megaframe.X` as forks of the warm server
            bin_dir = warm_start.shim(str(root), server, sys.executable) + os.pathsep + bin_dir
        self.env = env(
            PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            PET_STANDALONE="1",
            VIRTUAL_ENV=sys.prefix,
        )
        self.done: dict[str, str] = {}  # page -> "" when its commands passed, else the failure

    def run(self, page: str) -> str:
        if page not in self.done:
            if page != "README.md" and self.run("README.md"):
                return "README.md's tour failed first"
            self.done[page] = self._run(page)
        return self.done[page]

    def _run(self, page: str) -> str:
        timings = []
        try:
            for c in commands(page):
                if not c.runs:
                    continue
                line = " ".join([c.code, *small_overrides(c)])
                t0, cpu0 = time.perf_counter(), _children_cpu_s()
                res = subprocess.run(
                    ["bash", "-c", f"set -o pipefail; {line}"],
                    cwd=self.work,
                    env=self.env,
                    capture_output=True,
                    text=True,
                    timeout=TIMEOUT_S,
                )
                timings.append((c.where, time.perf_counter() - t0, _children_cpu_s() - cpu0))
                if res.returncode != c.expected_exit:
                    return (
                        f"{c.where}: exit {res.returncode} (expected {c.expected_exit}) from\n  {line}\n"
                        f"stdout: {res.stdout[-1500:]}\nstderr: {res.stderr[-2500:]}"
                    )
                if c.expected_exit == 2 and "megaframe: error:" not in res.stdout + res.stderr:
                    return f"{c.where}: exit 2 without a one-line `megaframe: error:`: {res.stderr[-1000:]}"
            return ""
        finally:
            # CPU seconds too: on a shared machine the wall time says more about the neighbours
            print("\n".join(f"{where}: {s:.1f}s wall, {cpu:.1f}s CPU" for where, s, cpu in timings))


@pytest.fixture(scope="module")
def journey(demo_prepared, tmp_path_factory):  # the checkout's demo corpus, as `make train` leaves it
    return Journey(tmp_path_factory.mktemp("docs"))


RUN_PAGES = [p for p in PAGES if any(c.runs for c in commands(p))]


@pytest.mark.parametrize("page", RUN_PAGES)
def test_page_commands_run_in_order(page, journey):
    failure = journey.run(page)
    assert not failure, failure
