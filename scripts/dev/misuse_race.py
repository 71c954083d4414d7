"""Writers racing for one folder, judged as one attempt of scripts/dev/misuse_rerun.py (exit 0: held, exit 1:
not held, with one line saying why).

    python scripts/dev/misuse_race.py cmds SPEC.json
        SPEC: {"cmds": [[argv], ...], "winners": N or null, "then": [[argv], ...]}. Starts every command at
        once; held when every one exits 0 or 2 (an exit 2 with one `megaframe: error:` line), none prints a
        traceback, exactly N exit 0 (null: any number), and then each `then` command exits 0 (e.g. a verify
        of what the winners wrote).
    python scripts/dev/misuse_race.py locks DIR TRIALS [--squeue]
        TRIALS times: a run lock left by a dead pid on this host (what kill -9 leaves; --squeue: by a job on
        another host that a slow squeue reports COMPLETED), then three long-lived processes call the
        project's RunLock(folder).acquire() at one instant. Held when every trial has exactly one holder.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a file: `tests` importable
# the program each racing process runs: the one the lock takeover test races
from tests.unit.runops.test_lock_takeover import TAKER  # noqa: E402


def _judge(i: int, rc: int, out: str) -> str | None:
    if "Traceback (most recent call last)" in out:
        return f"writer {i}: a traceback ({_last(out)})"
    if rc not in (0, 2):
        return f"writer {i}: exit {rc} ({_last(out)})"
    errors = {ln for ln in out.splitlines() if ln.startswith("megaframe: error:")}
    if rc == 2 and len(errors) != 1:
        return f"writer {i}: exit 2 with {len(errors)} error lines"
    return None


def _last(out: str) -> str:
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if "error" in ln.lower()]
    return (errs or lines or [""])[-1][:200]


def race_cmds(spec: dict) -> tuple[bool, str]:
    procs = [
        subprocess.Popen(
            c, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
        for c in spec["cmds"]
    ]
    outs = [p.communicate()[0] for p in procs]
    rcs = [p.returncode for p in procs]
    for i, (rc, out) in enumerate(zip(rcs, outs)):
        print(f"writer {i}: exit {rc}: {_last(out)}")
        if (why := _judge(i, rc, out)) is not None:
            return False, why
    want = spec.get("winners")
    if want is not None and rcs.count(0) != want:
        return False, f"{rcs.count(0)} writers exited 0, expected {want} (exits {rcs})"
    for c in spec.get("then") or []:
        res = subprocess.run(c, cwd=ROOT, capture_output=True, text=True, errors="replace")
        if res.returncode != 0:
            return (
                False,
                f"afterwards {' '.join(map(str, c[-3:]))} exited {res.returncode}: "
                f"{_last(res.stdout + res.stderr)}",
            )
    return True, f"exits {rcs}"


def race_locks(base: Path, trials: int, squeue: bool) -> tuple[bool, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    if squeue:  # a busy controller: 0.5 s to say that job 999 has finished widens any check-then-remove gap
        (base / "bin").mkdir(parents=True, exist_ok=True)
        stub = base / "bin" / "squeue"
        stub.write_text(f"#!{sys.executable}\nimport time; time.sleep(0.5); print('COMPLETED')\n")
        stub.chmod(0o755)
        env["PATH"] = f"{base / 'bin'}:{env.get('PATH', '')}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TAKER],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    holder = (
        {"host": "node-that-is-gone", "pid": 4242, "job": "SLURM_JOB_ID=999"}
        if squeue
        else {"host": socket.gethostname(), "pid": dead.pid, "job": ""}
    )
    counts = []
    try:
        for t in range(trials):
            folder = base / f"run{t}"
            folder.mkdir(parents=True)
            (folder / "megaframe.lock").write_text(json.dumps({"since": time.time() - 3600, **holder}))
            start = time.time() + 0.5  # every taker waits on its clock for the same instant
            for p in procs:
                p.stdin.write(f"{folder} {start}\n")
                p.stdin.flush()
            answers = [_answer(p) for p in procs]
            counts.append(answers.count("HOLDS"))
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=120)
    bad = sum(c != 1 for c in counts)
    return bad == 0, f"trials without exactly one holder: {bad} of {trials} (holders {counts})"


def _answer(proc) -> str:
    while (line := proc.stdout.readline().strip()) not in ("HOLDS", "BUSY", ""):
        pass
    return line


def main(argv: list[str]) -> int:
    if argv[:1] == ["cmds"]:
        held, why = race_cmds(json.loads(Path(argv[1]).read_text()))
    elif argv[:1] == ["locks"]:
        held, why = race_locks(Path(argv[1]), int(argv[2]), "--squeue" in argv)
    else:
        print(__doc__)
        return 2
    print(("held: " if held else "NOT HELD: ") + why)
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
