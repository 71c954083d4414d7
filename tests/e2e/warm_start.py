"""A warm interpreter that starts the e2e tests' `python train.py` and `python -m megaframe.X` by fork.

Why: of the ~2.5 s of CPU a tiny `python train.py` takes here, ~2 s is the interpreter importing torch,
hydra and megaframe before the first line of the run (`import torch` alone: 1.8 s), and the suite starts
several hundred such commands on 2 cores. The server (one per pytest worker, started on first use)
imports them once; each command is then a fork of it that runs what `python ARGS` would (runpy, as the
interpreter does for a script or `-m`) with its own argv, environment, working directory, stdin, stdout
and stderr (the caller's file descriptors, passed over the socket: pipes and redirections behave as they
would), process group and exit code (a death by signal reads as -signal, as subprocess reports it).
Ranks are still separate processes talking gloo.

Two callers: tests/e2e/helpers.py (run / train) and `python` itself for the docs' shell commands: shim()
writes an executable `python` that forwards an eligible command here and execs the real interpreter for
anything else (`-c`, `-m pip`, flags), and a `torchrun` that is its `python -m torch.distributed.run`. A
forked command's own `sys.executable` is the server's shim, so what it starts with `[sys.executable,
SCRIPT.py, ...]` (scripts/compare_rules.py's two runs, the benchmarks scripts/gpu_check.py runs) is forked
too, and the rest runs on the real interpreter as before.

What a fork cannot give, so the tests whose subject it is start real processes (`fresh=True` in
helpers.run / helpers.train, or their own subprocess): the interpreter's own start (imports timed, a
signal during start-up), srun's agent (the Slurm tests run real jobs), a worker whose parent is its
torchrun agent (a fork's parent is the server), and a hash seed per process (every fork shares the
server's). The environment torch and the interpreter read at start is the server's: a command that
changes one (`READ_AT_START`) starts fresh. megaframe reads its variables when called, not at import.
MEGAFRAME_TEST_FORK=0 turns the server off.

Protocol: one SEQPACKET connection per command; the caller sends {"argv", "env", "cwd"} with its stdin,
stdout and stderr descriptors; the server answers {"pid"} once forked and {"rc"} once it reaped the child.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import sys

# what train.py and the megaframe CLIs import before their first line of work (a train run's sys.modules)
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed",
    "hydra",
    "omegaconf",
    "safetensors.torch",
    "sentencepiece",
    "megaframe.runops.signals",
    "megaframe.config",
    "megaframe.errors",
    "megaframe.tracking",
    "megaframe.training.trainer",
)
# environment the interpreter and the preloaded modules read once, at start: a command that sets one
# differently starts fresh. Not TORCHINDUCTOR_* / TORCHDYNAMO_*: the server never imports the compiler (a
# fork that compiles imports it after its environment is set), and an in-process compile sets
# TORCHINDUCTOR_CACHE_DIR in a pytest worker's environment
READ_AT_START = ("OMP_", "MKL_", "KMP_", "TORCH_", "PYTHON", "CUDA", "LD_", "MALLOC")
# ...except these: read when a process group is made, not at import (torchrun's agent sets
# TORCH_NCCL_ASYNC_ERROR_HANDLING for its workers)
READ_LATER = ("TORCH_NCCL_",)


def unbuffered(args: list[str]) -> tuple[bool, list[str]]:
    """(whether `-u` leads the interpreter's arguments, the arguments without it)."""
    return (True, args[1:]) if args[:1] == ["-u"] else (False, args)


def eligible(args: list[str]) -> bool:
    """`[-u] SCRIPT.py ...`, `[-u] -m megaframe.X ...` or `-m torch.distributed.run ...` (the interpreter's
    arguments, without the interpreter): torchrun's agent forked too starts its workers (`-u train.py`) with
    the fork's sys.executable, the server's shim, so they are forks as well."""
    args = unbuffered(args)[1]
    if not args:
        return False
    module = args[1] if args[0] == "-m" and len(args) > 1 else ""
    return args[0].endswith(".py") or module.startswith("megaframe") or module == "torch.distributed.run"


def start_signature(env: dict) -> tuple:
    """What of `env` is read at start: two environments with the same signature can share a server."""
    return tuple(
        sorted((k, v) for k, v in env.items() if k.startswith(READ_AT_START) and not k.startswith(READ_LATER))
    )


def same_start(env: dict, server_env: dict) -> bool:
    """Whether `env` agrees with the server's on everything read at start."""
    return start_signature(env) == start_signature(server_env)


# ---------------------------------------------------------------------------------------------- the child


def _exit_code(e: SystemExit) -> int:
    """What the interpreter makes of sys.exit(x): None 0, an int itself, anything else printed and 1."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _stdio(unbuffered: bool) -> None:
    """Fresh sys.std* over fds 0-2 (now the command's), buffered as a new interpreter's would be."""
    sys.stdin = open(0, closefd=False)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        line = unbuffered or name == "stderr" or os.isatty(fd)
        stream = open(fd, "w", closefd=False, buffering=1 if line else -1)
        if unbuffered:
            stream.reconfigure(write_through=True)
        setattr(sys, name, stream)
    sys.__stdout__, sys.__stderr__, sys.__stdin__ = sys.stdout, sys.stderr, sys.stdin


def _run(argv: list[str]) -> None:
    import runpy

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def _child(req: dict, fds: list[int], executable: str) -> None:
    """In the fork: become the command, run it, end as the interpreter would (threads joined, atexit);
    `executable` is what it sees as sys.executable."""
    code = 1
    try:
        # its own process group (a timeout kills the command and whatever it started); the server sets it
        # too, so that it exists before the caller can learn the pid (the shells' way)
        os.setpgid(0, 0)
        # the server's child-exit wake-up is not the command's: SIGCHLD back to its default, the pipe closed
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in _WAKE:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        flag, argv = unbuffered(req["argv"])
        _stdio(bool(req["env"].get("PYTHONUNBUFFERED")) or flag)
        sys.executable = executable
        try:
            _run(argv)
            code = 0
        except SystemExit as e:
            code = _exit_code(e)
        except BaseException:
            sys.excepthook(*sys.exc_info())
        import threading

        threading._shutdown()
        import atexit

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


# --------------------------------------------------------------------------------------------- the server


_WAKE: tuple[int, ...] = ()
"""The server's SIGCHLD wake-up pipe (read end, write end); a fork closes both."""


def serve(path: str) -> None:
    """Accept commands on the socket at `path`, fork one child each; end when stdin closes (the pytest
    worker is gone), killing what still runs. Single-threaded: a fork of a threaded process can inherit a
    lock another thread held."""
    # the checkout's megaframe, as `python train.py` run in it imports: started as tests/e2e/warm_start.py,
    # this interpreter's sys.path[0] is tests/e2e, and megaframe came from wherever the environment installs
    # it (another worktree's editable install: every fork then ran that code, not the one under test)
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name in PRELOAD:
        importlib.import_module(name)
    # the first composition's one-time work (ConfigStore registrations, Hydra's override grammar, the
    # config package's lazy imports: ~0.2 s of CPU), done once; each call starts from a cleared GlobalHydra
    from megaframe.config import load_config

    load_config(["data=synthetic"])
    # the forks' sys.executable: their own python commands come back here (or run on the real interpreter)
    executable = os.path.join(shim(os.path.dirname(os.path.abspath(path)), path, sys.executable), "python")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    start_env = dict(os.environ)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    # commands whose caller went away (a shim killed by SIGKILL, as torchrun's agent ends a worker that
    # ignores SIGTERM): killed with it, as the real process would have been, then reaped
    orphaned: set[int] = set()
    # a child's exit wakes the loop (SIGCHLD's handler writes to a pipe the loop watches) instead of a poll
    # every 20 ms: the server idles for most of a suite, and the poll cost it ~7 ms of CPU a second
    global _WAKE
    _WAKE = os.pipe()
    for fd in _WAKE:
        os.set_blocking(fd, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a Python handler, so that the wake-up fd is written
    signal.set_wakeup_fd(_WAKE[1], warn_on_full_buffer=False)
    open_ = True
    while open_ or children:
        # a caller never writes after its request: its connection turning readable is its end
        watched = [c for pid, c in children.items() if pid not in orphaned]
        # the timeout only a safety net: every event the loop acts on makes one of these readable
        ready, _, _ = select.select([listener, 0] * open_ + watched + [_WAKE[0]], [], [], 1.0)
        if _WAKE[0] in ready:
            try:
                os.read(_WAKE[0], 4096)
            except BlockingIOError:
                pass
        if 0 in ready:
            open_ = bool(os.read(0, 4096))
        if listener in ready:
            _start(listener, start_env, children, executable)
        for pid, conn in list(children.items()):
            if conn in ready or not open_:
                orphaned.add(pid)
                kill_group(pid)
        _reap(children)
        orphaned &= children.keys()  # a reaped pid may be a later command's


def _start(listener: socket.socket, start_env: dict, children: dict, executable: str) -> None:
    """Take one request: fork its command (into `children`) or refuse it (the caller starts it fresh)."""
    conn, _ = listener.accept()
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    req = json.loads(msg)
    if not same_start(req["env"], start_env):
        conn.send(json.dumps({"pid": None}).encode())
        conn.close()
        for fd in fds:
            os.close(fd)
        return
    pid = os.fork()
    if pid == 0:
        listener.close()
        for c in (*children.values(), conn):
            c.close()
        _child(req, fds, executable)
    try:
        os.setpgid(pid, pid)
    except OSError:  # it has set it itself, or already ended
        pass
    for fd in fds:
        os.close(fd)
    conn.send(json.dumps({"pid": pid}).encode())
    children[pid] = conn


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        conn = children.pop(pid)
        try:
            conn.send(json.dumps({"rc": rc}).encode())
        except OSError:  # the caller went away (a shim killed with its shell)
            pass
        conn.close()


def readable(f, timeout_s: float) -> bool:
    """Whether `f` (a file object, socket or descriptor) has something to read within `timeout_s`. poll, not
    select: a pytest worker may hold descriptors numbered past select's 1024."""
    p = select.poll()
    p.register(f, select.POLLIN)
    return bool(p.poll(timeout_s * 1000))


def kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    """`sig` to the command's process group; one that has ended already is left alone (the shim passes a
    signal on that may arrive after its command ended: torchrun's agent SIGTERMs every worker once one
    fails, and a shim that raised here ended with 1 instead of the command's own code)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


# --------------------------------------------------------------------------------------------- the caller


class Command:
    """A forked command, as much of subprocess.Popen as the tests use: pid, poll, wait, kill, returncode."""

    def __init__(self, argv: list[str], env: dict, cwd: str, fds: tuple[int, int, int], path: str):
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.conn.connect(path)
        req = json.dumps({"argv": argv, "env": env, "cwd": str(cwd)}).encode()
        socket.send_fds(self.conn, [req], list(fds))
        # a fork of an imported interpreter takes milliseconds; a minute is a server that hangs
        self.conn.settimeout(60)
        self.pid = json.loads(self.conn.recv(4096))["pid"]  # None: refused (environment read at start)
        self.returncode: int | None = None
        if self.pid is None:
            self.conn.close()

    def poll(self) -> int | None:
        if self.returncode is None and readable(self.conn, 0):
            self._read_rc()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.conn.settimeout(timeout)
            try:
                self._read_rc()
            except TimeoutError:
                import subprocess

                raise subprocess.TimeoutExpired(str(self.pid), timeout) from None
        return self.returncode

    def _read_rc(self) -> None:
        msg = self.conn.recv(4096)
        # an empty read: the server died with the command unreaped; report it killed
        self.returncode = json.loads(msg)["rc"] if msg else -signal.SIGKILL
        self.conn.close()

    def kill(self) -> None:
        kill_group(self.pid)


def shim(folder: str, path: str, real: str) -> str:
    """Write `folder/python`: eligible commands as forks of the server at `path`, the rest (and those the
    server refuses, see same_start) exec'd on `real`; and `folder/torchrun`, which is `python -m
    torch.distributed.run` (torch's torchrun script runs that module's main): a page's `torchrun ...` then
    forks its agent and workers as `python -m torch.distributed.run ...` does, instead of starting three fresh
    interpreters (~6 s of CPU). Returns the folder, for the front of PATH."""
    here = os.path.dirname(os.path.abspath(__file__))
    for name, argv in (("python", ""), ("torchrun", 'sys.argv[1:1] = ["-m", "torch.distributed.run"]\n')):
        text = (
            f"#!{real} -IS\n"
            f"import sys\nsys.path.insert(0, {here!r})\n{argv}"
            f"from warm_start import shim_main\nshim_main({path!r}, {real!r})\n"
        )
        target = os.path.join(folder, name)
        with open(target, "w") as f:
            f.write(text)
        os.chmod(target, 0o755)
    return folder


def shim_main(path: str, real: str) -> None:
    """The shim's body: forward to the server, pass signals on to the command, exit as it did."""
    args = sys.argv[1:]
    if not eligible(args) or not os.path.exists(path):
        os.execv(real, [real, *args])
    cmd = Command(args, dict(os.environ), os.getcwd(), (0, 1, 2), path)
    if cmd.pid is None:
        os.execv(real, [real, *args])
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, _: kill_group(cmd.pid, s))
    rc = cmd.wait()
    if rc < 0:
        # end by the command's signal (SIGKILL's handler cannot be set, nor needs resetting)
        if -rc not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    sys.exit(rc)


if __name__ == "__main__":
    serve(sys.argv[1])
