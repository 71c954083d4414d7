"""The e2e tests' warm start (tests/e2e/warm_start.py) stands for a fresh `python`: argv, environment,
working directory, output, exit code and death by signal are the command's own; what the interpreter reads
at start decides fresh; the docs' `python` shim forwards pipes and exit codes through a real shell."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.e2e import helpers, warm_start

SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "x", os.environ.get("X"))
    print("to stderr", file=sys.stderr)
    if sys.argv[1:2] == ["hang"]:
        import time
        time.sleep(600)
    if sys.argv[1:2] == ["fail"]:
        raise ValueError("a traceback as python prints it")
    sys.exit(int(sys.argv[1]))
    """
)


@pytest.fixture(scope="module")
def server():
    path = helpers.warm_server()
    if path is None:
        pytest.skip("the warm server is off (MEGAFRAME_TEST_FORK=0)")
    return path


def _fork(server, tmp_path, *args, **env):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    out, err = tmp_path / "out", tmp_path / "err"
    with open(os.devnull) as null, open(out, "w") as o, open(err, "w") as e:
        fds = (null.fileno(), o.fileno(), e.fileno())
        cmd = warm_start.Command([str(script), *args], helpers.env(**env), str(tmp_path), fds, server)
    return cmd, out, err


def test_a_forked_command_has_its_own_argv_env_cwd_output_and_exit_code(server, tmp_path):
    cmd, out, err = _fork(server, tmp_path, "3", "b c", X="seen")
    assert cmd.pid != os.getpid() and cmd.wait(timeout=60) == 3
    assert out.read_text() == f"argv ['3', 'b c'] cwd {tmp_path} x seen\n"
    assert err.read_text() == "to stderr\n"
    cmd, out, err = _fork(server, tmp_path, "fail")
    assert cmd.wait(timeout=60) == 1 and "ValueError: a traceback as python prints it" in err.read_text()


def test_a_killed_command_reads_as_killed_by_its_signal(server, tmp_path):
    cmd, _, _ = _fork(server, tmp_path, "hang")
    assert cmd.poll() is None
    cmd.kill()
    assert cmd.wait(timeout=60) == -signal.SIGKILL


def test_what_the_interpreter_reads_at_start_decides_a_fresh_start(server, tmp_path):
    cmd, _, _ = _fork(server, tmp_path, "0", OMP_NUM_THREADS="2")
    assert cmd.pid is None  # refused: the caller starts a fresh interpreter
    res = helpers.run([sys.executable, "-c", "import os; print(os.getppid())"])
    assert res.stdout.strip() == str(os.getpid())  # not eligible: a child of this process, not of the server


def test_the_shim_forwards_pipes_and_exit_codes_through_a_shell(server, tmp_path):
    (tmp_path / "probe.py").write_text(SCRIPT)
    folder = warm_start.shim(str(tmp_path), server, sys.executable)
    e = helpers.env(PATH=f"{folder}{os.pathsep}{os.environ['PATH']}")
    line = "python probe.py 5 | tr a-z A-Z; echo rc=${PIPESTATUS[0]}; python -c 'print(6*7)'"
    res = subprocess.run(
        ["bash", "-c", line], cwd=tmp_path, env=e, capture_output=True, text=True, timeout=60
    )
    assert res.stdout.splitlines() == [f"ARGV ['5'] CWD {str(tmp_path).upper()} X NONE", "rc=5", "42"]
    assert res.stderr == "to stderr\n"


def test_a_worker_whose_own_environment_moved_still_forks(server, tmp_path, monkeypatch):
    """An in-process compile sets TORCHINDUCTOR_CACHE_DIR in the worker's environment: not read at the
    server's start, so the same server takes the commands; a variable that is read at start (TORCH_*) gets
    a server started with it, not a refusal of every later command."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert helpers.warm_server() == server
    cmd, out, _ = _fork(server, tmp_path, "0")
    assert cmd.pid is not None and cmd.wait(timeout=60) == 0
    monkeypatch.setenv("TORCH_SHOW_CPP_STACKTRACES", "1")
    other = helpers.warm_server()
    assert other not in (None, server)
    cmd, out, _ = _fork(other, tmp_path, "0")
    assert cmd.pid is not None and cmd.wait(timeout=60) == 0


def test_what_a_forked_command_starts_with_its_own_python_is_forked_too(server, tmp_path):
    """scripts/compare_rules.py runs train.py twice with sys.executable: from a fork, those are forks of the
    server (torch already imported at their first line), and `-c` still runs on the real interpreter."""
    (tmp_path / "inner.py").write_text("import sys\nprint('warm' if 'torch' in sys.modules else 'fresh')\n")
    (tmp_path / "outer.py").write_text(
        "import subprocess, sys\n"
        "subprocess.run([sys.executable, 'inner.py'], check=True)\n"
        "subprocess.run([sys.executable, '-c', 'import sys; print(\"torch\" in sys.modules)'], check=True)\n"
    )
    out = tmp_path / "out"
    with open(os.devnull) as null, open(out, "w") as o:
        fds = (null.fileno(), o.fileno(), o.fileno())
        cmd = warm_start.Command(["outer.py"], helpers.env(), str(tmp_path), fds, server)
    assert cmd.wait(timeout=60) == 0
    assert out.read_text().split() == ["warm", "False"]


def test_the_shim_of_a_command_killed_by_sigkill_ends_by_sigkill(server, tmp_path):
    """torchrun's agent reads a worker killed by SIGKILL from the shim's own end (it exited 1 instead)."""
    (tmp_path / "sleeper.py").write_text("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(600)\n")
    folder = warm_start.shim(str(tmp_path), server, sys.executable)
    shim = os.path.join(folder, "python")
    proc = subprocess.Popen([shim, "sleeper.py"], cwd=tmp_path, env=helpers.env(), stdout=subprocess.PIPE)
    fork = int(proc.stdout.readline())
    assert fork != proc.pid  # the command runs in the server's fork, the shim waits for it
    os.kill(fork, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def test_a_signal_to_the_shim_after_its_command_ended_keeps_the_commands_exit_code():
    """torchrun's agent SIGTERMs every worker once one fails: a shim whose command had just ended (its code
    not yet read) raised ProcessLookupError passing the signal on, and ended with 1 instead of the code."""
    ended = subprocess.Popen(["true"], start_new_session=True)
    ended.wait()
    warm_start.kill_group(ended.pid, signal.SIGTERM)  # no group left: nothing to pass it to, no error
