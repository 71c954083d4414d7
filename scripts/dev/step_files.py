"""The files a reader opens to follow one training step: every megaframe file whose code runs in one
steady-state iteration of the loop (from the second call of `optimizer_step` to the third: the batch, the
step, the optimizer, the meter, the stop and save checks), plus train.py and the loop's own file.

    PYTHONPATH=. python scripts/dev/step_files.py [hydra overrides ...]

Runs train.py in this process for 3 steps on the demo data (or what the overrides say) into a temporary
folder, then prints the files in the order they were first entered and their count.
"""

from __future__ import annotations

import runpy
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    seen: dict[str, None] = {}
    calls = [0]

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_name == "optimizer_step" and "megaframe" in code.co_filename:
            calls[0] += 1
        if calls[0] == 2 and code.co_filename.startswith(str(ROOT / "megaframe")):
            seen.setdefault(str(Path(code.co_filename).relative_to(ROOT)), None)

    work = tempfile.mkdtemp(prefix="step-files-")
    sys.argv = [
        "train.py",
        "train.max_steps=3",
        f"run.dir={work}/run",
        f"checkpoint.dir={work}/ckpt",
        "checkpoint.interval=0",
        "logging.wandb.mode=disabled",
        *sys.argv[1:],
    ]
    sys.setprofile(profile)
    try:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
    files = ["train.py"] + list(seen)
    print(*files, sep="\n")
    print(f"{len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
