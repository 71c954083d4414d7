"""Sharded checkpoints: every rank writes its share into one safetensors file; rank 0 commits only when
every rank succeeded and the pieces tile every tensor exactly once.

Layout on disk:
    ${checkpoint.dir}/step_00000008/shard_00000.safetensors ...   stored tensors keyed <logical key>#<n>
                                                                   (model/<name>, optim/<kind>/<name>),
                                                                   a crc32 per block in the header
    ${checkpoint.dir}/step_00000008/metadata.json                 every logical tensor's global shape and
                                                                   dtype, and each stored piece's global box
    ${checkpoint.dir}/latest                                       name of the newest committed step folder

Who writes what (checkpoint/layout.py): each slice several ranks hold (dp replicas, tp replicas of a
replicated tensor) is cut in row chunks over them, and each ZeRO rank writes its own segments, so every
rank writes about total/world bytes and nothing is gathered for a write.
Commit on agreement: every rank reports (ok, size, header checksum, its entries); rank 0 checks them
all and the coverage, writes metadata.json last (fsynced), renames the folder, then replaces `latest`
atomically; on any failure nothing is committed, the temporary folder is removed and every rank raises
SaveError. Loading (checkpoint/load.py) reads per-rank plans of byte ranges.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from megaframe.checkpoint import lineage
from megaframe.checkpoint.layout import my_writes, param_items, state_buffers  # noqa: F401  (public API)
from megaframe.checkpoint.load import load_agreed, load_full, load_into, load_newest  # noqa: F401  (public API)
from megaframe.checkpoint.metadata import (
    FORMAT,
    CheckpointError,
    check_complete,
    check_coverage,
    committed,  # noqa: F401  (public API)
    confined,
    position_problem,
    sealed,
)
from megaframe.checkpoint.metadata import read as read_metadata  # noqa: F401
from megaframe.checkpoint.staging import PinnedStaging
from megaframe.checkpoint.store import shard_name, verify_file, write_file
from megaframe.parallel import comm
from megaframe.parallel.mesh import Mesh


class SaveError(RuntimeError):
    """A save that was not committed (a rank's write failed, or the coverage check did not pass)."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def begin(root: str | Path, step: int, mesh: Mesh) -> tuple[Path, Path]:
    """Create the (empty) temporary folder of a checkpoint; collective. Returns (tmp, final)."""
    final = step_dir(root, step)
    # only the commit's rename creates `final`: no reader sees half a save
    tmp = final.with_name(final.name + ".tmp")
    error = None
    if mesh.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        # rank 0 alone: a .tmp left by a crashed save was wiped, so no stale shard joins this one
        try:
            tmp.mkdir(parents=True)
        except OSError as e:  # a full disk: every rank hears it below rather than waiting for rank 0
            error = f"checkpoint step {step} not committed: cannot create {tmp}: {e}"
    # no rank may write its shard before rank 0 has (re)created the folder (a barrier through comm)
    error = comm.gather_objects(error, mesh.group)[0]
    if error is not None:
        raise SaveError(error)
    return tmp, final


def host_snapshot(model, optimizer, mesh: Mesh, copy: bool, pin: bool | PinnedStaging = False) -> list:
    """This rank's stored tensors (checkpoint/layout.py) with their data on the host; `copy` detaches
    them from the live state so training may go on while they are written; `pin` stages the device
    tensors in page-locked memory (an async save on CUDA: the device-to-host copies then run at full
    speed), in the given PinnedStaging's one buffer (reused by every save) or, with True, a new one."""
    stored = my_writes(param_items(model, optimizer, mesh, with_sources=True))
    staging = pin if isinstance(pin, PinnedStaging) else (PinnedStaging() if pin else None)
    on_device = [s for s in stored if s.source.device.type == "cuda"]
    staged = dict(zip(map(id, on_device), staging.views([s.source for s in on_device]))) if staging else {}
    for s in stored:
        t = s.source.detach()
        # a blocking save may write CPU params in place (training waits); a background one needs its own copy,
        # the next step updates them in place
        if id(s) in staged:
            t = staged[id(s)].copy_(t, non_blocking=True)
        elif t.device.type != "cpu" or copy:
            t = torch.empty(t.shape, dtype=t.dtype).copy_(t)
        s.source = t.contiguous()
    if staged:
        torch.cuda.synchronize()  # the non_blocking copies must land before the writer thread reads them
    return stored


def write_report(folder: Path, rank: int, stored: list, fail: str | None = None) -> dict:
    """Write this rank's file; returns what the commit needs (never raises for an I/O failure)."""
    t0 = time.perf_counter()
    name = shard_name(rank)
    try:
        info = write_file(folder, rank, {s.stored_key: s.source for s in stored}, fail) if stored else None
    except Exception as e:  # noqa: BLE001  (OSError, safetensors' SafetensorError, whatever the write raises)
        # reported, not raised: a rank that raised here would
        # miss the gather in finish() and hang its peers there
        return {
            "rank": rank,
            "ok": False,
            "error": f"rank {rank}: {' '.join(str(e).split()) or type(e).__name__}",
        }
    entries: dict[str, dict] = {}
    for s in stored:
        e = entries.setdefault(s.key, {"global_shape": list(s.global_shape), "dtype": s.dtype, "shards": []})
        e["shards"].append(
            {
                "file": name,
                "key": s.stored_key,
                "shape": list(s.shape),
                "dtype": s.dtype,
                "pieces": [[list(map(list, a)), list(map(list, b))] for a, b in s.pieces],
            }
        )
    return {
        "rank": rank,
        "ok": True,
        "file": name if info else None,
        "info": info,
        "entries": entries,
        "write_bytes": info["bytes"] if info else 0,
        "data_bytes": info["data_bytes"] if info else 0,
        "save_s": time.perf_counter() - t0,
    }


def save(
    root: str | Path,
    step: int,
    model,
    optimizer,
    mesh: Mesh,
    meta: dict,
    keep_last: int = 0,
    fail: str | None = None,
    io: dict | None = None,
) -> Path:
    """Write and commit step_XXXXXXXX under root; collective over the mesh. Returns the final folder;
    SaveError (on every rank) when it was not committed. `io` receives this rank's figures."""
    t0 = time.perf_counter()
    tmp, final = begin(root, step, mesh)
    # copy=True: serialising views of live params exports their storage (safetensors goes through numpy),
    # after which ZeRO-3 can no longer resize (free) a block's gathered storage
    report = write_report(tmp, mesh.rank, host_snapshot(model, optimizer, mesh, copy=True), fail)
    report["save_s"] = time.perf_counter() - t0
    final = finish(root, tmp, final, step, meta, report, mesh, keep_last)
    if io is not None:
        io.update({"ckpt/write_bytes": report["write_bytes"], "ckpt/save_s": report["save_s"]})
    return final


def finish(
    root, tmp: Path, final: Path, step: int, meta: dict, report: dict, mesh: Mesh, keep_last: int
) -> Path:
    """Gather every rank's report, commit on rank 0 if all agree, and tell every rank; collective."""
    # every rank reaches this gather, failed or not; only rank 0 acts on the reports
    reports = comm.gather_objects(report, mesh.group)
    outcome = None
    if mesh.rank == 0:
        outcome = decide(root, tmp, final, step, meta, reports, keep_last)
    # rank 0's verdict goes to all, so every rank raises SaveError or none does (a lone raise would
    # desynchronise the next collective)
    outcome = comm.gather_objects(outcome, mesh.group)[0]
    if outcome is not None:
        raise SaveError(outcome)
    return final


def io_figures(reports: list[dict]) -> dict:
    """Per-rank bytes and seconds of a save, for metadata.json and the metrics."""
    return {
        str(r["rank"]): {"write_bytes": r.get("write_bytes", 0), "save_s": round(r.get("save_s", 0.0), 4)}
        for r in reports
    }


def decide(
    root, tmp: Path, final: Path, step: int, meta: dict, reports: list[dict], keep_last: int
) -> str | None:
    """Commit if every rank wrote its file and the pieces tile every tensor; else remove the temporary
    folder, leave `latest` and every older checkpoint as they are, and return the reason."""
    failed = [r["error"] for r in reports if not r["ok"]]
    reason = None
    if failed:
        reason = f"{len(failed)} of {len(reports)} ranks failed to write ({failed[0]})"
    else:
        tensors = merge_entries(reports)
        try:
            check_coverage(tensors)
        except CheckpointError as e:
            reason = f"coverage check failed: {e}"
    if reason is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        return f"checkpoint step {step} not committed: {reason}"
    files = {r["file"]: r["info"] for r in reports if r["file"]}
    try:
        commit(root, tmp, final, step, {**meta, "io": io_figures(reports)}, tensors, files)
    # rank 0's metadata or pointer write on a full disk: a verdict, so no peer waits for one
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        return f"checkpoint step {step} not committed: rank 0: {e}"
    # only after the new checkpoint is committed: a crash in
    # between never leaves fewer than keep_last good ones
    prune(root, keep_last, (meta.get("lineage") or {}).get("owner"))
    return None


def merge_entries(reports: list[dict]) -> dict:
    tensors: dict[str, dict] = {}
    for r in reports:
        for k, e in r["entries"].items():
            t = tensors.setdefault(k, {"global_shape": e["global_shape"], "dtype": e["dtype"], "shards": []})
            if t["global_shape"] != e["global_shape"]:
                t["shape_conflict"] = e["global_shape"]
            t["shards"] += e["shards"]
    for k, t in tensors.items():
        if "shape_conflict" in t:
            raise CheckpointError(
                f"tensor {k}: ranks disagree on its global shape "
                f"({t['global_shape']} vs {t['shape_conflict']})"
            )
    return tensors


def commit(root, tmp: Path, final: Path, step: int, meta: dict, tensors: dict, files: dict) -> None:
    """metadata.json last (fsynced), atomic rename of the folder, then the `latest` pointer."""
    # last of the folder: check_complete treats a folder with
    # metadata.json as whole, so the shards must be on disk first
    _fsync_write(
        tmp / "metadata.json",
        json.dumps(
            {
                "format": FORMAT,
                "step": step,
                **sealed(meta),
                "files": files,
                "coverage": "exact",
                "tensors": tensors,
            },
            indent=1,
        ),
    )
    if final.exists():
        keep_aside(final)
    os.replace(tmp, final)
    # the pointer moves only once the folder is in place: a crash
    # before leaves it naming the previous complete checkpoint
    try:
        _fsync_write(Path(root) / "latest.tmp", final.name + "\n")
        os.replace(Path(root) / "latest.tmp", Path(root) / "latest")
    except OSError:
        # `latest` still names the previous checkpoint: put the folder back, so what is reported as not
        # committed is not taken for the newest checkpoint by a later resume either
        Path(root, "latest.tmp").unlink(missing_ok=True)
        os.replace(final, tmp)
        raise


def keep_aside(final: Path) -> Path | None:
    """A step folder about to be written again (a rollback reaching a step number the abandoned branch
    already has) is renamed, not deleted: other branches are never deleted. The new name is no step_<digits>,
    so resume, the tools and keep_last pass it over; a person decides about it. A folder that holds no
    committed checkpoint (no metadata.json) is removed. Returns the new name."""
    if not (final / "metadata.json").is_file():
        shutil.rmtree(final)
        return None
    aside = final.with_name(f"{final.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 0
    while aside.exists():  # two rollbacks to one step within a second
        n += 1
        aside = aside.with_name(f"{final.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
    os.replace(final, aside)
    print(
        f"megaframe: warning: {final} held another branch's checkpoint {lineage.origin(aside)}; renamed it "
        f"{aside.name}",
        file=sys.stderr,
        flush=True,
    )
    return aside


def prune(root: str | Path, keep_last: int, owner: str | None = None) -> None:
    """Keep the newest `keep_last` checkpoints of the current lineage (0 keeps everything): by lineage,
    not by step number, so a rollback's new branch is never pruned, nor another run's
    (checkpoint/lineage.py)."""
    lineage.prune(root, keep_last, owner)


def verify(path: str | Path) -> dict:
    """Full offline verification: metadata complete, coverage exact, the sealed sample position unedited,
    every byte of every file against its checksums. Returns the metadata; CheckpointError (a ValueError)
    naming the file otherwise."""
    meta = check_complete(path)
    check_coverage(meta["tensors"])
    edited = position_problem(meta)  # what a resume would refuse: the sample position edited by hand
    if edited:
        raise CheckpointError(f"{Path(path) / 'metadata.json'}: {edited}")
    if "v1_files" in meta:  # a v1 checkpoint: one crc32 per whole file
        from megaframe.checkpoint.load import file_crc32

        for name, want in meta["v1_files"].items():
            if file_crc32(confined(path, name)) != want["crc32"]:
                raise CheckpointError(f"{path}: shard {name} is corrupt (crc32 mismatch)")
        return meta
    for name, want in meta["files"].items():
        verify_file(Path(path), name, want)
    return meta


def latest(root: str | Path, on_skip=None) -> Path | None:
    """The newest committed checkpoint under root whose metadata is complete (files present with their
    sizes), decided without reading shard bytes; `on_skip(path, reason)` hears about each passed over.
    Shard bytes are checked where they are read (load_newest falls back past one that fails)."""
    for path in committed(root)[::-1]:
        try:
            check_complete(path)
            return path
        except CheckpointError as e:
            if on_skip:
                on_skip(path, str(e))
    return None
