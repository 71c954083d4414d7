"""Run train.py / torchrun / prepare as a user would, in subprocesses with a hard timeout."""

from __future__ import annotations

import atexit
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.e2e import warm_start

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=128",
    "model.seq_length=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "optim.warmup_steps=2",
    "optim.lr=3e-3",
]


def env(gpu: bool = False, **extra) -> dict:
    """The command's environment. CPU only unless `gpu`: with train.device=auto on a GPU host, 2-4 torchrun
    ranks would share one GPU (NCCL does not support that) and the suite would not be the CPU suite."""
    e = dict(os.environ)
    e.update(WANDB_MODE="disabled", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if not gpu:
        e["CUDA_VISIBLE_DEVICES"] = ""
    e.update(extra)
    e.pop("MEGAFRAME_RUN_NAME", None)
    return e


def run(
    args: list[str],
    timeout: float = 300,
    gpu: bool = False,
    fresh: bool = False,
    cwd: Path = ROOT,
    **extra_env,
) -> subprocess.CompletedProcess:
    """`args` in `cwd` (the checkout) with env(); `python train.py ...` and `python -m megaframe.X ...` as a
    fork of the warm server (tests/e2e/warm_start.py) unless `fresh`: a test whose subject is the start of
    the interpreter (its imports, a signal during start-up) asks for a fresh one."""
    if not fresh and (proc := _start_warm(args, gpu, extra_env, cwd)) is not None:
        return _finish([proc], args, timeout, grace=None)
    return subprocess.run(
        args, cwd=cwd, env=env(gpu, **extra_env), capture_output=True, text=True, timeout=timeout
    )


def start(args: list[str], cwd: Path = ROOT, **extra_env) -> "_Started":
    """`args` started in the background as run() starts them, for a test that signals the running command:
    pid, poll, send_signal, communicate. Its stdout and stderr go to one file, in order (stderr=STDOUT)."""
    return _Started(args, Path(cwd), extra_env)


def train(
    overrides: list[str],
    nproc: int = 1,
    timeout: float = 300,
    launcher: str = "torchrun",
    fresh: bool = False,
    **extra_env,
) -> subprocess.CompletedProcess:
    """train.py at `nproc` ranks. launcher="env" starts the ranks directly with RANK / WORLD_SIZE /
    LOCAL_RANK / MASTER_ADDR / MASTER_PORT set, as srun does (see megaframe/parallel/launch.py): no torchrun
    agent (about 2 s of CPU and 1.5 s of wall per launch), for tests whose subject is not the launcher."""
    gpu = "train.device=cuda" in overrides  # the GPU tests (tests/gpu) ask for it by name
    if nproc > 1 and launcher == "env":
        return _train_env_ranks(overrides, nproc, timeout, gpu, extra_env, fresh)
    if nproc == 1:
        cmd = [sys.executable, "train.py"]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "train.py",
        ]
    return run(cmd + overrides, timeout=timeout, gpu=gpu, fresh=fresh, **extra_env)


def _start_warm(args: list[str], gpu: bool, extra_env: dict, cwd: Path = ROOT):
    """`args` as a fork of the warm server, or None where it cannot stand for a fresh interpreter (a
    command that sets what the interpreter reads at start: warm_start.READ_AT_START)."""
    server = _server_for(args, gpu, extra_env)
    if server is None:
        return None
    proc = _Forked(args[1:], env(gpu, **extra_env), server, cwd)
    return proc if proc.cmd.pid is not None else None


def _server_for(args: list[str], gpu: bool, extra_env: dict) -> str | None:
    """The warm server that may start `args`, or None."""
    if gpu or args[:1] != [sys.executable] or not warm_start.eligible(args[1:]):
        return None
    if any(k.startswith(warm_start.READ_AT_START) for k in extra_env):
        return None
    return warm_server()


_servers: dict[tuple, str | None] = {}  # start signature -> the socket of its server (None: did not come up)
_held: list[subprocess.Popen] = []  # the servers: their stdin closing (this worker ending) ends them
_OWNER = os.getpid()


@atexit.register
def _end_servers() -> None:
    """Each server ended and waited for as this worker exits: its CPU and its forks' then count among this
    process's children (what `/usr/bin/time pytest` reports; before, the servers outlived their worker and
    a measure of an e2e module missed every forked command)."""
    if os.getpid() != _OWNER:  # a fork of this worker inherits the hook, not the servers
        return
    for proc in _held:
        proc.stdin.close()
    for proc in _held:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def warm_server() -> str | None:
    """The socket of this pytest worker's warm server for env() as it is now (tests/e2e/warm_start.py),
    started on first use; None when MEGAFRAME_TEST_FORK=0 or it did not come up (then commands start
    fresh). One server per start signature: a test that moves this worker's own environment (an in-process
    compile sets TORCHINDUCTOR_CACHE_DIR) gets a server that started with it."""
    if os.environ.get("MEGAFRAME_TEST_FORK", "1") == "0":
        return None
    base = env()
    key = warm_start.start_signature(base)
    if key not in _servers:
        path = os.path.join(tempfile.mkdtemp(prefix="megaframe-warm-"), "socket")
        proc = subprocess.Popen(
            [sys.executable, warm_start.__file__, path], cwd=ROOT, env=base,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        _held.append(proc)
        # its imports take seconds; two minutes is a server that will not come up
        ok = warm_start.readable(proc.stdout, 120) and proc.stdout.readline().strip() == "ready"
        _servers[key] = path if ok else None
        if not ok:
            proc.kill()
    return _servers[key]


class _Output:
    """stdout and stderr in temporary files, read back once the command ended."""

    def __init__(self):
        self.files = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")

    def output(self) -> tuple[str, str]:
        texts = []
        for f in self.files:
            f.seek(0)
            texts.append(f.read())
            f.close()
        return texts[0], texts[1]


class _Forked(_Output):
    def __init__(self, argv: list[str], e: dict, server: str, cwd: Path = ROOT):
        super().__init__()
        with open(os.devnull) as null:
            fds = (null.fileno(), self.files[0].fileno(), self.files[1].fileno())
            self.cmd = warm_start.Command(argv, e, str(cwd), fds, server)
        self.poll, self.kill, self.wait = self.cmd.poll, self.cmd.kill, self.cmd.wait

    @property
    def returncode(self):
        return self.cmd.returncode


class _Started:
    """A background command (start()): a fork of the warm server where one may stand for it, else a fresh
    interpreter; either way the face of a subprocess.Popen with stderr=STDOUT."""

    def __init__(self, args: list[str], cwd: Path, extra_env: dict):
        self.file = tempfile.TemporaryFile()
        e, server, self.cmd = env(**extra_env), _server_for(args, False, extra_env), None
        if server is not None:
            with open(os.devnull) as null:
                fds = (null.fileno(), self.file.fileno(), self.file.fileno())
                self.cmd = warm_start.Command(args[1:], e, str(cwd), fds, server)
        if self.cmd is None or self.cmd.pid is None:
            self.cmd = subprocess.Popen(args, cwd=cwd, env=e, stdout=self.file, stderr=subprocess.STDOUT)
        self.pid, self.poll = self.cmd.pid, self.cmd.poll

    @property
    def returncode(self):
        return self.cmd.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def output(self) -> str:
        """What it printed so far (pread: the command writes at the file's shared offset, left alone)."""
        fd = self.file.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def communicate(self, timeout: float) -> tuple[str, None]:
        """Its output once it ended; past `timeout` it is killed and TimeoutExpired raised."""
        try:
            self.cmd.wait(timeout)
        except subprocess.TimeoutExpired:
            self.cmd.kill()
            self.cmd.wait()
            raise
        return self.output(), None


def _free_port() -> int:
    """A port below Linux's ephemeral range (32768-60999): no other process's outgoing connection takes it
    between this check and rank 0 binding it."""
    for _ in range(100):
        port = random.randint(12000, 31999)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 12000-31999")


def _train_env_ranks(overrides, nproc, timeout, gpu, extra_env, fresh) -> subprocess.CompletedProcess:
    """Each rank's stdout and stderr, rank 0 first; the exit code is the largest of the ranks' (srun's).
    The ranks are forks of the warm server where run() would fork (else fresh interpreters)."""
    port = str(_free_port())
    procs = []
    for rank in range(nproc):
        ranks = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
        ranks.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, "train.py", *overrides]
        proc = None if fresh else _start_warm(cmd, gpu, {**ranks, **extra_env})
        procs.append(proc if proc is not None else _Fresh(cmd, env(gpu, **ranks, **extra_env)))
    return _finish(procs, ["train.py", *overrides], timeout, grace=20)


class _Fresh(_Output):
    """A fresh interpreter: the same face as _Forked."""

    def __init__(self, cmd: list[str], e: dict):
        super().__init__()
        out, err = self.files
        self.popen = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=out, stderr=err, text=True)
        self.poll, self.kill, self.wait = self.popen.poll, self.popen.kill, self.popen.wait

    @property
    def returncode(self):
        return self.popen.returncode


def _finish(procs, args, timeout: float, grace: float | None) -> subprocess.CompletedProcess:
    """Wait for every process; past `timeout` kill them all and raise TimeoutExpired. With `grace`: once one
    fails, the others get that long to end on their own (they usually fail the same collective), then are
    killed, as srun --kill-on-bad-exit does: a survivor would otherwise wait out the dist timeout."""
    deadline, killed_at = time.monotonic() + timeout, None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                raise subprocess.TimeoutExpired(args, timeout)
            if grace is not None and killed_at is None and any(p.returncode for p in procs):
                killed_at = now + grace
            if killed_at is not None and now > killed_at:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            # block on a running command's end for at most 0.5 s (before: a poll every 20 ms, ~7 ms of this
            # worker's CPU a second for as long as the suite's commands run)
            running = [p for p in procs if p.poll() is None]
            if running:
                try:
                    running[0].wait(min(0.5, max(0.01, deadline - now)))
                except subprocess.TimeoutExpired:
                    pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = [p.output() for p in procs]
    code = max(procs, key=lambda p: abs(p.returncode)).returncode
    return subprocess.CompletedProcess(args, code, "".join(o for o, _ in texts), "".join(e for _, e in texts))


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl lines, the later line winning for a step logged twice (after a restart)."""
    rows = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = row
    return [rows[k] for k in sorted(rows)]
