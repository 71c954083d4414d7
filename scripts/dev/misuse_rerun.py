"""Bad input and lost work, re-run on the current code: every attempt a real command with its expected
outcome (refused configs, shared folders, lineage corruption, tool inputs, field ranges).

    python scripts/dev/misuse_rerun.py [--work DIR] [--only PREFIX] [--keep]

Prints one row per attempt (id, class, held/DEFECT, what was seen) and the counts; exits 1 when any
attempt shows a defect. Every attempt is also "clean": no Python traceback, and an exit 2 prints exactly
one `megaframe: error:` line (argparse's own usage error counts as one). Takes about 20-25 minutes on a
loaded 2-core box (it trains a few tiny runs); not part of `make test` (tests/e2e/test_lost_work_cli.py
holds the representative cases). The attempts are in scripts/dev/misuse_attempts.py and misuse_more.py.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: `scripts` importable
from scripts.dev.misuse_attempts import note_attempts, section2  # noqa: E402
from scripts.dev.misuse_base import ROOT, Attempt, Setup, environ  # noqa: E402
from scripts.dev.misuse_disk_schedule import disk_schedule_attempts  # noqa: E402
from scripts.dev.misuse_more import new_attempts  # noqa: E402
from scripts.dev.misuse_writers_data import writers_data_attempts  # noqa: E402


def _start_bg(a: Attempt) -> subprocess.Popen | None:
    if a.bg is None:
        return None
    proc = subprocess.Popen(
        a.bg, cwd=ROOT, env=environ(a.env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 120
    while a.bg_wait and not Path(a.bg_wait).exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    return proc


def verdict(a: Attempt, rc: int, out: str) -> str | None:
    """None when the attempt held, else what went wrong."""
    want = a.rc if isinstance(a.rc, tuple) else (a.rc,)
    if rc not in want:
        last = (out.strip().splitlines() or [""])[-1]
        return f"exit {rc}, expected {'/'.join(map(str, want))}: {last}"
    if "Traceback (most recent call last)" in out:
        return "a traceback"
    errors = [ln for ln in out.splitlines() if ln.startswith("megaframe: error:") or ": error: " in ln[:80]]
    if rc == 2 and len({ln for ln in errors}) != 1:
        return f"{len(errors)} error lines, expected one"
    for s in a.has:
        if s not in out:
            return f"no {s!r} in the output"
    for s in a.lacks:
        if s in out:
            return f"{s!r} in the output"
    return a.check() if a.check is not None else None


def attempt(a: Attempt) -> tuple[bool, str]:
    try:
        if a.prep is not None:
            a.prep()
        bg = _start_bg(a)
        try:
            res = subprocess.run(
                a.cmd,
                cwd=a.cwd or ROOT,
                env=environ(a.env),
                capture_output=True,
                text=True,
                errors="replace",
                timeout=a.timeout,
            )
            rc, out = res.returncode, res.stdout + res.stderr
        except subprocess.TimeoutExpired:
            rc, out = -1, "timed out (a hang?)"
        finally:
            _stop(bg)
        why = verdict(a, rc, out) if rc != -1 else out
    finally:  # a tmpfs is unmounted however the attempt went
        if a.after is not None:
            a.after()
    errs = [ln for ln in out.splitlines() if "error" in ln.lower()]
    seen = errs[-1] if errs else (out.strip().splitlines() or [""])[-1]
    return why is None, why or seen


def _stop(bg: subprocess.Popen | None) -> None:
    if bg is None:
        return
    bg.terminate()
    try:
        bg.wait(timeout=60)
    except subprocess.TimeoutExpired:
        bg.kill()
        bg.wait()


GROUPS = {
    "earlier": lambda s: note_attempts(s) + section2(s) + new_attempts(s),
    "writers-data": writers_data_attempts,
    "disk-schedule": disk_schedule_attempts,
}


def attempts(work: Path, group: str = "all") -> list[Attempt]:
    """Every attempt of the group (all: every group), after training the shared set-up once."""
    s = Setup(work)
    return [a for name, make in GROUPS.items() if group in ("all", name) for a in make(s)]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", help="folder for the runs (default: a new temporary folder)")
    ap.add_argument("--only", default="", help="run the attempts whose id starts with this")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument(
        "--group",
        default="all",
        choices=["all", *GROUPS],
        help="one list of attempts (two groups may run at once, each with its own --work)",
    )
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="misuse-rerun-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rows = []
    for a in attempts(work, args.group):
        if not a.id.startswith(args.only):
            continue
        try:
            held, what = attempt(a)
        except (Exception, SystemExit) as e:  # its set-up failed: the code under test did not do its part
            held, what = False, f"set-up failed: {' '.join(str(e).split())[:300]}"
        rows.append((a, held))
        print(f"{a.id:<8} {a.klass:<16} {'held' if held else 'DEFECT':<6} {what[:150]}", flush=True)
    bad = [a.id for a, held in rows if not held]
    print(
        f"\n{len(rows)} attempts, {len(rows) - len(bad)} "
        f"held, {len(bad)} defect{'s' if len(bad) != 1 else ''}"
        f"{': ' + ', '.join(bad) if bad else ''} ({time.time() - t0:.0f} s; work folder {work})"
    )
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
