"""Run every CUDA check (tests/gpu) on this machine's GPU and print one summary line per check.

    python scripts/gpu_check.py            # all of tests/gpu
    python scripts/gpu_check.py -k moe     # extra arguments go to pytest

Exit code: pytest's (0 when every check passed). Without CUDA every check is skipped and the summary
says so. The checks: no device sync in dense steps and one per MoE layer and micro-batch (fp32, bf16,
compile, recompute), SDPA's flash kernel on the model's attention, the fused cross-entropy in bf16 vs
fp32, the watchdog's enqueued-vs-completed states, a one-process checkpoint round trip (sync and
async), CPU vs CUDA losses, and the benchmark against transformers.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def summarize(junit: Path) -> list[tuple[str, str, float, str]]:
    """(test id, outcome, seconds, first line of the reason) per test case of a junit XML report."""
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                reason = (node.get("message") or node.text or "").strip().splitlines()[0][:100] if (
                    node.get("message") or node.text) else ""
                break
        rows.append((name, outcome, float(case.get("time", 0.0)), reason))
    return rows


def main(argv: list[str]) -> int:
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "gpu.xml"
        code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests/gpu"),
                                f"--junitxml={junit}", *argv], cwd=ROOT)
        rows = summarize(junit) if junit.is_file() else []
    print(f"\nGPU checks on {device}:")
    for name, outcome, seconds, reason in rows:
        print(f"  {outcome:<8} {seconds:7.1f}s  {name}" + (f"  ({reason})" if reason and outcome != "passed" else ""))
    counts = {o: sum(r[1] == o for r in rows) for o in ("passed", "FAILED", "ERROR", "skipped")}
    print("summary: " + ", ".join(f"{n} {o.lower()}" for o, n in counts.items() if n) +
          (" (no CUDA: nothing was checked)" if not torch.cuda.is_available() else ""))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
