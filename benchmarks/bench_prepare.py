"""Benchmark megaframe.data.prepare: tokens/s of the whole prepare (reading, hashing, tokenizing in
worker processes, writing shards) against the limit, sentencepiece's encode speed on one core.

    python benchmarks/bench_prepare.py [--source DIR] [--repeat N] [--workers 2] [--vocab 4096] [--tasks 4]

The corpus is the demo corpus (data/demo/corpus, 4.7 MB of books) copied `--repeat` times into a temp
folder, so the run is long enough to time. The tokenizer is trained once (timed apart) and then reused
with data.tokenizer=PATH, so the figures are for tokenization at scale, where training on a sample is a
small fixed cost. Printed: the one-core encode limit, prepare's end-to-end tokens/s with 1 and with
`--workers` processes, and the ratios to the limit (ideal: the worker count). Each figure is the best
of `--trials` runs, which filters out other jobs sharing the machine. CPU seconds are printed too
(prepare's main process plus its workers, for the tokenizing phase): they do not depend on other
load, and limit CPU / prepare CPU is the share of the work that is tokenizing proper.
With --tasks N: the same corpus prepared by 1 task and by N tasks (data.num_tasks, one worker each, N
processes at once as a job array runs them), with units small enough that each task gets a share; prints
tokens/s of each and the ratio N tasks / 1 task (ideal: min(N, cores)).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megaframe.config import load_config  # noqa: E402
from megaframe.data.prepare import prepare  # noqa: E402
from megaframe.data.prepare.sources import iter_documents, offline_hf, resolve_source, units  # noqa: E402
from megaframe.data.tokenizer import Tokenizer  # noqa: E402


def make_corpus(source: Path, repeat: int, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for r in range(repeat):
        for f in sorted(source.iterdir()):
            if f.is_file():
                shutil.copyfile(f, dst / f"r{r:02d}_{f.name}")
    return dst


def encode_limit(src: Path, tok_path: Path, cache: str) -> tuple[tuple[int, float], float]:
    """((tokens, cpu seconds), seconds) of sentencepiece encoding every document on one thread."""
    files = resolve_source(str(src))
    # data.split=file, as prepare
    docs = [d for g in units(files, 1 << 62) for b in iter_documents(g, "text", cache, "file") for d in b]
    tok = Tokenizer.load(tok_path)
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    for i in range(0, len(docs), 1024):
        n += sum(len(x) + 1 for x in tok.encode(docs[i : i + 1024], num_threads=1))  # + eos, as prepare
    return (n, time.process_time() - c0), time.perf_counter() - t0


def best(trials: int, fn):
    """fn() -> (result, seconds); the run with the fewest seconds."""
    return min((fn() for _ in range(trials)), key=lambda r: r[1])


def run_prepare(src: Path, out: Path, workers: int, tokenizer: Path | None, vocab: int) -> dict:
    over = [
        f"data.source={src}",
        f"data.path={out}",
        f"data.num_workers={workers}",
        f"data.vocab_size={vocab}",
    ]
    if tokenizer is not None:
        over.append(f"data.tokenizer={tokenizer}")
    return prepare(load_config(over, world_size=1, check_data=False), show_progress=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", default=str(ROOT / "data/demo/corpus"))
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument(
        "--tasks", type=int, default=0, help="also time 1 task against this many (data.num_tasks)"
    )
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        tmp = Path(tmp)
        src = make_corpus(Path(a.source), a.repeat, tmp / "corpus")
        mb = sum(f.stat().st_size for f in src.iterdir()) / 1e6
        print(
            f"corpus: {a.source} x{a.repeat} = {mb:.1f} MB on disk, {len(list(src.iterdir()))} files; "
            f"{os.cpu_count()} cores",
            flush=True,
        )
        t0 = time.perf_counter()
        trained = run_prepare(src, tmp / "trained", a.workers, None, a.vocab)
        print(
            f"with tokenizer training (vocab {a.vocab}): {time.perf_counter() - t0:.1f}s "
            f"(training {trained['stats']['tokenizer_seconds']:.1f}s)",
            flush=True,
        )
        tok = tmp / "tokenizer.model"
        shutil.copyfile(tmp / "trained" / "tokenizer.model", tok)
        with tempfile.TemporaryDirectory() as cache, offline_hf(cache):
            (n, limit_cpu), secs = best(a.trials, lambda: encode_limit(src, tok, cache))
        limit = n / secs
        print(
            f"limit: sentencepiece encode, 1 core: {n:,} tokens in {secs:.2f}s = {limit:,.0f} tokens/s "
            f"({limit_cpu:.2f} CPU s)",
            flush=True,
        )
        for w in sorted({1, a.workers}):

            def once(w=w):
                shutil.rmtree(tmp / f"w{w}", ignore_errors=True)
                t0 = time.perf_counter()
                meta = run_prepare(src, tmp / f"w{w}", w, tok, a.vocab)
                return meta, time.perf_counter() - t0

            meta, wall = best(a.trials, once)
            assert meta["num_tokens"] == n, (meta["num_tokens"], n)
            enc = meta["num_tokens"] / meta["stats"]["encode_seconds"]
            print(
                f"prepare, {w} worker(s): {wall:.2f}s end to end = {n / wall:,.0f} tokens/s "
                f"(ratio to the 1-core limit {n / wall / limit:.2f}); tokenizing phase {enc:,.0f} tokens/s "
                f"(ratio {enc / limit:.2f}); tokenizing CPU {meta['stats']['encode_cpu_seconds']:.2f}s "
                f"(limit CPU / this: {limit_cpu / meta['stats']['encode_cpu_seconds']:.2f})",
                flush=True,
            )
        if a.tasks > 1:
            bench_tasks(src, tmp, tok, a.tasks, a.trials)


def run_tasks(src: Path, out: Path, tok: Path, tasks: int, unit_bytes: int) -> float:
    """Wall seconds of `tasks` prepare processes at once (one worker each) on units of unit_bytes."""
    code = (
        f"import sys; from megaframe.data import prepare as p; p.UNIT_BYTES = {unit_bytes}; "
        "sys.exit(p.main(sys.argv[1:]))"
    )
    over = [
        f"data.source={src}",
        f"data.path={out}",
        f"data.tokenizer={tok}",
        "data.num_workers=1",
        f"data.num_tasks={tasks}",
    ]
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, *over, f"data.task={i}"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(tasks)
    ]
    for p in procs:
        _, err = p.communicate()
        assert p.returncode == 0, err
    return time.perf_counter() - t0


def bench_tasks(src: Path, tmp: Path, tok: Path, tasks: int, trials: int) -> None:
    unit = max(1 << 16, sum(f.stat().st_size for f in src.iterdir()) // (4 * tasks))  # ~4 units per task
    walls = {}
    for n in (1, tasks):

        def once(n=n):
            shutil.rmtree(tmp / f"t{n}", ignore_errors=True)
            return None, run_tasks(src, tmp / f"t{n}", tok, n, unit)

        walls[n] = best(trials, once)[1]
    import json

    tokens = json.loads((tmp / f"t{tasks}" / "meta.json").read_text())["num_tokens"]
    print(
        f"prepare as tasks (units of {unit / 1e6:.1f} MB, one "
        f"worker each): 1 task {tokens / walls[1]:,.0f} tokens/s, "
        f"{tasks} tasks {tokens / walls[tasks]:,.0f} tokens/s; "
        f"ratio {tasks} tasks / 1 task: {walls[1] / walls[tasks]:.2f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
