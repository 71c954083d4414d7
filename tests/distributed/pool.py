"""A pool of gloo ranks reused across tests: spawned once per session, each job runs on the first n.

Every worker joins one 4-rank gloo world (1 thread each, 2 cores). A job is (fn, tp, pp, n, args, ep, p2p,
shard, cp, etp): all workers build (or reuse) the mesh over ranks [0, n) — group creation is collective over
the whole world — then ranks < n call fn(mesh, *args). Point-to-point semantics follow
MEGAFRAME_P2P_SEMANTICS (the suite sets nccl, tests/conftest.py) unless a job names its own `p2p`. Results
come back through pipes. Every collective has the process-group timeout and every wait here has its own, so
a broken test fails instead of hanging.

Jobs and results cross the pipes pickled by value, not with multiprocessing's pickler: that one moves each
tensor into shared memory, and the receiving process keeps a descriptor open on it for as long as the tensor
lives. The layout tests keep their one-process references for a whole module, so the pytest worker of the
process lane held thousands of them (past select()'s 1,024), and a tensor a test passed became shared memory
in the test's own process.
"""

from __future__ import annotations

import datetime
import os
import pickle
import traceback

import torch.multiprocessing as mp

from megaframe.parallel.local import free_port

JOB_TIMEOUT_S = 240
COLLECTIVE_TIMEOUT_S = 60


def _worker(rank: int, size: int, port: int, conn) -> None:
    import torch
    import torch.distributed as dist

    from megaframe.parallel.mesh import build_mesh
    from megaframe.parallel.p2p_semantics import ENV_VAR
    from megaframe.pipeline import p2p

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    meshes = {}
    while True:
        job = _recv(conn)
        if job is None:
            break
        fn, tp, pp, n, args, ep, semantics, shard, cp, etp, node, lanes = job
        try:
            key = (tp, pp, n, ep, semantics, shard, cp, etp, node, lanes)
            if key not in meshes:  # groups are cached: creating them per job would leak sockets
                suite = os.environ.get(ENV_VAR)
                if semantics is not None:
                    os.environ[ENV_VAR] = semantics  # build_mesh reads it once
                try:
                    meshes[key] = build_mesh(
                        tp,
                        pp,
                        torch.device("cpu"),
                        range(n),
                        ep,
                        shard=shard,
                        cp=cp,
                        etp=etp,
                        node=node,
                        lanes=lanes,
                    )
                finally:
                    os.environ.pop(ENV_VAR, None)
                    if suite is not None:
                        os.environ[ENV_VAR] = suite
                if meshes[key] is not None:
                    p2p.warm_up(meshes[key].pp, torch.device("cpu"))
            mesh = meshes[key]
            if mesh is not None:
                mesh.stats.pop()
            _send(conn, (True, fn(mesh, *args) if mesh is not None else None))
        except BaseException:  # report, keep serving; the test decides
            _send(conn, (False, traceback.format_exc()))
    dist.destroy_process_group()


def _send(conn, obj) -> None:
    """obj by value (see the module's docstring)."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn):
    """What _send sent, by value."""
    return pickle.loads(conn.recv_bytes())


class RankPool:
    def __init__(self, size: int = 4):
        ctx = mp.get_context("spawn")
        port = free_port()
        self.size, self.conns, self.procs = size, [], []
        for r in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, size, port, child), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self.broken = False

    def run(
        self,
        fn,
        n: int,
        *args,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        p2p: str | None = None,
        shard: int = 0,
        timeout: float = JOB_TIMEOUT_S,
        cp: int = 1,
        etp: int = 1,
        node: int = 0,
        lanes: int = 1,
    ) -> list:
        """Run fn(mesh, *args) on ranks [0, n) with the given layout; returns their results in rank order.
        `p2p` (native | nccl) overrides the suite's point-to-point semantics for this job's mesh; `shard`:
        HSDP shard group size (0 = dp); `node`: ranks per node of parallel.ep_dispatch=node (0: not by
        node); `lanes`: 2 for the overlapped pipeline kinds (their compute axes' twin communicators)."""
        assert not self.broken, "pool broken by an earlier timeout or a dead worker"
        assert n <= self.size
        try:
            for c in self.conns:
                _send(c, (fn, tp, pp, n, args, ep, p2p, shard, cp, etp, node, lanes))
        except OSError as e:  # a worker that died since the last job: the next test gets a fresh pool
            raise self._died(e) from e
        results, errors = [], []
        for r, c in enumerate(self.conns):
            if not c.poll(timeout):
                self.broken = True
                self.close()
                raise TimeoutError(f"rank {r} gave no result in {timeout}s")
            try:
                ok, val = _recv(c)
            except (EOFError, OSError) as e:  # it died in this job (a crash: exit code -11 is SIGSEGV)
                raise self._died(e) from e
            (results if ok else errors).append(val if ok else f"rank {r}:\n{val}")
        if errors:
            raise RuntimeError("\n".join(errors))
        return results[:n]

    def _died(self, e: BaseException) -> RuntimeError:
        """Mark the pool broken (the `pool` fixture then starts a new one), say which workers died how and
        end the others (they may wait in a collective with the dead one)."""
        self.broken = True
        for p in self.procs:  # the dead one's exit code is there once it is reaped
            p.join(timeout=0.5)
        codes = {r: p.exitcode for r, p in enumerate(self.procs) if p.exitcode is not None}
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        return RuntimeError(f"a pool worker died ({e!r}); exit codes of the dead ranks: {codes}")

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs):
            try:
                if p.is_alive() and not self.broken:
                    _send(c, None)
            except (BrokenPipeError, OSError):
                pass
        for c, p in zip(self.conns, self.procs):
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
            c.close()  # a replaced pool leaves none of its pipes open in the pytest worker
