"""Process-group start-up from the launcher's environment (torchrun, Slurm's srun, or nothing).

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT. Under srun without torchrun
the SLURM_* variables describe the rank; torchrun's names win when both exist (inside torchrun workers
the SLURM_* variables describe the agent). One process needs no process group at all.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

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
    if not torch.cuda.is_available():
        from megaframe.config import ConfigError
        raise ConfigError("train.device=cuda but CUDA is not available on this machine")
    # before init_process_group: NCCL binds each rank to the current device
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


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


def init_distributed(env: DistEnv, device: torch.device, timeout_s: float = 600.0, run_dir: str | None = None) -> None:
    """NCCL on CUDA, gloo on CPU; every collective times out after `timeout_s` (train.dist_timeout_s)
    instead of hanging. On CUDA, NCCL's async error handling and flight recorder are switched on, with
    dumps under `run_dir` (see nccl_env)."""
    if env.world_size == 1 or dist.is_initialized():
        return
    if device.type == "cuda" and run_dir is not None:
        nccl_env(run_dir)
    # one host without a launcher's address: rank 0 hosts the store locally
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        job = int(os.environ.get("SLURM_JOB_ID", "0"))
        os.environ["MASTER_PORT"] = str(20000 + job % 10000)  # per-job port: jobs may share a host
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=_store(env, timeout), rank=env.rank, world_size=env.world_size,
                            timeout=timeout, **({"device_id": device} if device.type == "cuda" else {}))


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
