"""Process-group start-up from the launcher's environment (torchrun, Slurm's srun, or nothing).

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT. Under srun without torchrun
the SLURM_* variables describe the rank; torchrun's names win when both exist (inside torchrun workers
the SLURM_* variables describe the agent). One process needs no process group at all.
"""

from __future__ import annotations

import datetime
import itertools
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int


def env_ranks() -> DistEnv:
    env = os.environ
    # torchrun's names first: inside torchrun workers the SLURM_* variables describe the agent
    rank = int(env.get("RANK", env.get("SLURM_PROCID", "0")))
    world = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", "1")))
    local = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", "0")))
    return DistEnv(rank, world, local)


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    from megaframe.errors import ConfigError

    if not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but CUDA is not available on this machine")
    local, gpus = local_world_size(), torch.cuda.device_count()
    if local > gpus:  # NCCL does not support one device for several ranks of a communicator: it may hang
        raise ConfigError(
            f"train.device={choice}: {local} ranks on this node but {gpus} GPU(s); NCCL needs one GPU "
            "per rank: start at most one rank per GPU, or pass train.device=cpu"
        )
    # before init_process_group: NCCL binds each rank to the current device
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def local_world_size(environ=os.environ) -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE, else the srun step's tasks per node ("8(x2)": 8;
    the step's, not the job's: one `python train.py` inside a many-task allocation is one rank), else 1."""
    if environ.get("LOCAL_WORLD_SIZE"):
        return int(environ["LOCAL_WORLD_SIZE"])
    per_node = re.match(r"\d+", environ.get("SLURM_STEP_TASKS_PER_NODE", ""))
    return int(per_node.group()) if per_node else 1


def ranks_per_host(hosts: list[str]) -> int:
    """Ranks per node from every rank's host name, in rank order. The node axes take consecutive ranks as
    one node, as torchrun and srun's block distribution place them: a host whose ranks are not consecutive
    (srun --distribution=cyclic) or hosts with different numbers of ranks raise ValueError, naming them."""
    blocks = [(host, len(list(run))) for host, run in itertools.groupby(hosts)]
    names = [host for host, _ in blocks]
    split = next((h for h in names if names.count(h) > 1), None)
    if split is not None:
        ranks = [r for r, h in enumerate(hosts) if h == split]
        raise ValueError(f"host {split} holds ranks {ranks[:6]}, not consecutive (a cyclic rank layout)")
    sizes = {n for _, n in blocks}
    if len(sizes) > 1:
        raise ValueError(f"the hosts hold different numbers of ranks: {dict(blocks[:4])}")
    return sizes.pop()


def dispatch_node(p, world: int, environ=os.environ, hosts: list[str] | None = None) -> int:
    """Ranks per node for parallel.ep_dispatch=node (parallel.ranks_per_node, else counted from every rank's
    `hosts` where given, else the launcher's), checked against the layout before any process group: 0 when
    the ep all-to-all does not go by node. Counted from the host names, every rank gets the same answer; the
    launcher's count is this rank's alone (a node given fewer ranks would cut the groups differently)."""
    from megaframe.errors import ConfigError
    from megaframe.parallel.rank_grid import RankGrid

    if p.ep_dispatch != "node" or p.ep == 1:
        return 0
    if not p.ranks_per_node and hosts is not None:
        try:
            node = ranks_per_host(hosts)
        except ValueError as e:
            raise ConfigError(
                f"parallel.ep_dispatch=node: {e}; set parallel.ranks_per_node to override"
            ) from e
    else:
        node = p.ranks_per_node or local_world_size(environ)
    try:
        grid = RankGrid(p.tp, world // (p.tp * p.pp * p.cp), p.pp, ep=p.ep, cp=p.cp, etp=p.etp, node=node)
    except ValueError as e:
        where = f"parallel.ranks_per_node={p.ranks_per_node}" + (
            "" if p.ranks_per_node else f" ({node}: the launcher's)"
        )
        raise ConfigError(f"{where}: {e}") from e
    # an ep group inside one node: the plain all-to-all is the same exchange (no node axes, no groups)
    return node if len(grid.groups("ep_rail")[0]) > 1 else 0


def job_hosts(p, world: int) -> list[str] | None:
    """Every rank's host name, in rank order, where dispatch by node needs the nodes counted (one gather
    over the default group at start-up); None elsewhere."""
    from megaframe.parallel.comm import gather_objects

    if p.ep_dispatch != "node" or p.ep == 1 or p.ranks_per_node or world == 1:
        return None
    return gather_objects(socket.gethostname(), dist.group.WORLD)


NCCL_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # a failed or timed-out collective aborts the communicator and
    # ends the process, instead of leaving the others hanging
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",  # flight recorder: each rank's last 20000 collectives
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # written out when NCCL's watchdog sees a timeout
}
"""NCCL diagnosis settings (as torchtitan sets them); a value the user exported wins."""


def nccl_env(run_dir: str, environ=os.environ) -> dict[str, str]:
    """Set NCCL_DEFAULTS and the flight recorder's dump prefix ${run_dir}/nccl_trace/rank_ (torch appends
    the rank) wherever the user has not; returns what was set. torch reads the prefix when it first
    dumps, so calling this again once the ranks agree on run_dir (trainer.run) moves the dumps there."""
    wanted = {**NCCL_DEFAULTS, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{run_dir}/nccl_trace/rank_"}
    ours = environ.get("MEGAFRAME_NCCL_DUMP_PREFIX")  # set by an earlier call: still ours to move
    if ours is not None and environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE") == ours:
        del environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    done = {k: v for k, v in wanted.items() if k not in environ}
    environ.update(done)
    if "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" in done:
        environ["MEGAFRAME_NCCL_DUMP_PREFIX"] = done["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    return done


def init_distributed(
    env: DistEnv, device: torch.device, timeout_s: float = 600.0, run_dir: str | None = None
) -> None:
    """NCCL on CUDA, gloo on CPU; every collective times out after `timeout_s` (train.dist_timeout_s)
    instead of hanging. On CUDA, NCCL's async error handling and flight recorder are switched on, with
    dumps under `run_dir` (see nccl_env)."""
    if env.world_size == 1 or dist.is_initialized():
        return
    if "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = master_addr(os.environ)
    if "MASTER_PORT" not in os.environ:
        job = int(os.environ.get("SLURM_JOB_ID", "0"))
        os.environ["MASTER_PORT"] = str(20000 + job % 10000)  # per-job port: jobs may share a host
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _store(env, timeout)
    if device.type == "cuda" and run_dir is not None:
        early_dump_dir(store, env.rank, run_dir)  # before init_process_group: NCCL reads its settings there
    dist.init_process_group(
        backend,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        **({"device_id": device} if device.type == "cuda" else {}),
    )


def early_dump_dir(store: dist.Store, rank: int, run_dir: str, environ=os.environ) -> str:
    """Point the flight recorder at rank 0's run folder and create the dump folder, before the first
    collective: a hang in build_mesh or the first broadcast (the typical wrong-NIC hang) must leave its
    dumps, and torch only opens the file. The ranks may not agree on run.dir yet (timestamped names),
    so rank 0's goes through the rendezvous store: no stray per-rank folders. Returns the agreed dir."""
    if rank == 0:
        store.set("nccl_dump_run_dir", run_dir)
    agreed = store.get("nccl_dump_run_dir").decode()
    nccl_env(agreed, environ)
    Path(environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]).parent.mkdir(parents=True, exist_ok=True)
    return agreed


_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


def master_addr(environ=os.environ) -> str:
    """MASTER_ADDR when the launcher gave none: the loopback on one host; under a plain multi-node
    `srun python train.py` the first node of the step (where Slurm puts task 0). The loopback there would
    make every other node dial itself until dist_timeout_s."""
    nodes = int(environ.get("SLURM_STEP_NUM_NODES", environ.get("SLURM_NNODES", "1")))
    if nodes <= 1:
        return "127.0.0.1"
    for var in _NODELIST_VARS:
        if environ.get(var):
            return first_host(environ[var])
    from megaframe.errors import ConfigError

    raise ConfigError(
        f"SLURM_NNODES={nodes} but MASTER_ADDR is not set and no {'/'.join(_NODELIST_VARS)} "
        "names the nodes: export MASTER_ADDR=<first node> (scripts/slurm/pretrain.sbatch does)"
    )


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list as `scontrol show hostnames` expands it:
    "gpu[007-010,12],cpu1" -> "gpu007", "rack[1-2]-n[01-04]" -> "rack1-n01"."""
    depth, first = 0, ""
    for ch in nodelist:  # the first comma outside brackets ends the first entry
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            break
        first += ch
    # each bracket's first range starts with the first value (zero padding kept)
    return re.sub(r"\[([^\]\-,]+)[^\]]*\]", r"\1", first.strip())


def _store(env: DistEnv, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store, with keys private to this restart attempt.

    Under torchrun the agent hosts the store and keeps it across worker restarts; without a prefix the
    restarted ranks can read a dead rank's address left by the previous attempt and hang in the
    process-group handshake (seen with gloo on torch 2.13). Elsewhere rank 0 hosts it.
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, env.world_size, is_master=not agent and env.rank == 0, timeout=timeout)
    return dist.PrefixStore(f"megaframe/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
