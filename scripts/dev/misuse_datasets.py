"""Prepared data sets and trained runs the writer, data-identity and checksum attempts of
scripts/dev/misuse_rerun.py share, each made on first use (so `--only` works on any attempt):

- docs512: the project's docs/ (copied once, so a docs edit mid-run changes nothing) with its own
  512-piece tokenizer; scr512: scripts/ with docs512's tokenizer; docsdemo: docs/ with the demo's tokenizer
  (a second data set of the demo's vocabulary);
- runs on them (blend, stages), and an HF export of the shared set-up's checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from scripts.dev.misuse_base import ROOT, TINY, TRAIN, Setup, py, sh

PREPARE = py("-m", "megaframe.data.prepare")
VERIFY = py("-m", "megaframe.data", "verify")
CKPT_VERIFY = py("-m", "megaframe.checkpoint", "verify")


class Data:
    def __init__(self, s: Setup):
        self.s, self.w = s, s.work
        self.src = self.w / "src"

    def source(self, name: str) -> Path:
        """A frozen copy of one of the checkout's folders (text only)."""
        dst = self.src / name
        if not dst.is_dir():
            shutil.copytree(ROOT / name, dst, ignore=shutil.ignore_patterns("__pycache__", "*.png", "*.pyc"))
        return dst

    def at(self, name: str) -> Path:
        """Where docs512, scr512 or docsdemo is (prepared by `prepared`, which the attempts' set-ups call)."""
        return self.w / "data" / name

    def prepared(self, name: str) -> Path:
        """docs512, scr512 or docsdemo, prepared once."""
        out = self.at(name)
        if not (out / "meta.json").is_file():
            src = "scripts" if name == "scr512" else "docs"
            tok = (
                "data.vocab_size=512"
                if name == "docs512"
                else f"data.tokenizer={self.prepared('docs512') / 'tokenizer.model'}"
                if name == "scr512"
                else f"data.tokenizer={self.s.data / 'tokenizer.model'}"
            )
            sh([*PREPARE, f"data.source={self.source(src)}", f"data.path={out}", "data.num_workers=1", tok])
        return out

    def ready(self) -> None:
        for name in ("docs512", "scr512", "docsdemo"):
            self.prepared(name)

    def copy(self, name: str, of: str | Path) -> Path:
        """A fresh copy of a prepared folder (to damage)."""
        src = of if isinstance(of, Path) else self.prepared(of)
        dst = self.w / "data" / name
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
        return dst

    def blend(self, *parts: tuple[str, float]) -> str:
        items = ", ".join(f"{{path: {self.at(p)}, weight: {wt}}}" for p, wt in parts)
        return f"data.blend=[{items}]"

    def stages(self, first_until: int = 2, extra: str = "") -> str:
        d, c = self.at("docs512"), self.at("scr512")
        return (
            f"data.stages=[{{until_step: {first_until}, blend: [{{path: {d}, weight: 1}}]}}, "
            f"{extra}{{blend: [{{path: {d}, weight: 0.5}}, {{path: {c}, weight: 0.5}}]}}]"
        )

    def run(self, name: str, *over: str, steps: int = 2) -> list[str]:
        """A tiny training command on this set's data (no data.path: the blend or stages replace it)."""
        return [
            *TRAIN,
            *TINY,
            f"run.dir={self.w / name}",
            f"train.max_steps={steps}",
            f"checkpoint.interval={steps}",
            *over,
        ]

    def trained(self, name: str, *over: str, steps: int = 2) -> Path:
        """The checkpoint dir of a run made once."""
        ck = self.w / name / "checkpoints"
        self.ready()
        if not (ck / "latest").is_file():
            sh(self.run(name, *over, steps=steps))
        return ck

    def stages_run(self) -> Path:
        return self.trained("wd-stages", self.stages(), steps=3)

    def blend_run(self) -> Path:
        return self.trained("wd-blend", self.blend(("docs512", 0.5), ("scr512", 0.5)))

    def hf(self) -> Path:
        """The shared set-up's live checkpoint exported once as a transformers folder."""
        out = self.w / "hf"
        if not (out / "config.json").is_file():
            sh(py("scripts/export_hf.py", str(self.s.ck), str(out), "--force"))
        return out

    def hf_copy(self, name: str) -> Path:
        dst = self.w / name
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(self.hf(), dst)
        return dst


def flip_byte(f: Path, at: float = 0.5) -> None:
    """One byte of the file inverted, at a fraction of its length."""
    data = bytearray(f.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    f.write_bytes(bytes(data))


def truncate(f: Path, keep: float = 0.5) -> None:
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * keep)])


def first_shard(folder: Path, key: str = "file") -> Path:
    return folder / json.loads((folder / "meta.json").read_text())["shards"][0][key]


def edit_json(f: Path, fn) -> None:
    meta = json.loads(f.read_text())
    fn(meta)
    f.write_text(json.dumps(meta))


def spec(path: Path, cmds: list[list[str]], winners: int | None = 1, then: list[list[str]] = ()) -> None:
    """The command list scripts/dev/misuse_race.py starts at one instant."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "cmds": [list(map(str, c)) for c in cmds],
                "winners": winners,
                "then": [list(map(str, c)) for c in then],
            }
        )
    )


def verify_if_published(folder: Path) -> list[str]:
    """A prepared OUT is either absent or complete: verify it when it is there."""
    code = (
        f"import pathlib, subprocess, sys; p = pathlib.Path({str(folder)!r}); "
        f"sys.exit(subprocess.call([sys.executable, '-m', 'megaframe.data', 'verify', str(p)]) "
        f"if p.exists() else 0)"
    )
    return py("-c", code)
