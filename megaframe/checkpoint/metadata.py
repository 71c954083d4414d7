"""Checkpoint metadata: the coverage check a commit must pass, the completeness check `latest` uses
(metadata only, no shard bytes), and file names confined to the checkpoint folder.

metadata.json (format v2):
    files:   {name: {"bytes": size, "header_crc32": crc of the safetensors header}}; the header holds a
             crc32 per fixed-size block of every stored tensor, so the header checksum covers all bytes
    tensors: {logical key: {"global_shape", "dtype", "shards": [{"file", "key", "shape",
             "pieces": [[stored box, global box], ...]}]}}
    coverage: "exact" (set by the commit after check_coverage passed)
    position_sha256: {field: sha256} of the fields a resume's sample position is read from (POSITION_FIELDS)
v1 checkpoints ({"dim", "ranges"} per shard, a crc32 per whole file) are read through `upgrade`.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np

from megaframe.paths import OutsideFolder, inside

FORMAT = "megaframe-ckpt-v2"
FORMAT_V1 = "megaframe-ckpt-v1"


class CheckpointError(ValueError):
    """A checkpoint (or a save) that cannot be used; the message names the file or tensor."""


def confined(folder: str | Path, name: str) -> Path:
    """folder/name when name is a plain file name inside folder; CheckpointError otherwise."""
    try:
        return inside(folder, name)
    except OutsideFolder as e:
        raise CheckpointError(str(e)) from e


def check_coverage(tensors: dict) -> None:
    """Every logical tensor's stored pieces tile its global shape exactly once: in bounds, shapes and
    dtypes consistent, no overlap, no gap. CheckpointError naming the first tensor that fails."""
    for key, info in tensors.items():
        shape = tuple(info["global_shape"])
        nd = len(shape)
        los, his = [], []
        for s in info["shards"]:
            if s.get("dtype", info["dtype"]) != info["dtype"]:
                raise CheckpointError(
                    f"tensor {key}: dtype {s['dtype']} in {s['file']}, {info['dtype']} elsewhere"
                )
            stored = 0
            for local, glob in s["pieces"]:
                if len(glob) != nd or len(local) != len(s["shape"]):
                    raise CheckpointError(f"tensor {key}: a piece in {s['file']} has the wrong rank")
                if any(not (0 <= lo < hi <= n) for (lo, hi), n in zip(glob, shape)) or any(
                    not (0 <= lo < hi <= n) for (lo, hi), n in zip(local, s["shape"])
                ):
                    raise CheckpointError(f"tensor {key}: a piece in {s['file']} lies outside its tensor")
                if [hi - lo for lo, hi in local] != [hi - lo for lo, hi in glob]:
                    raise CheckpointError(f"tensor {key}: a piece in {s['file']} changes shape")
                los.append([lo for lo, _ in glob])
                his.append([hi for _, hi in glob])
                stored += math.prod(hi - lo for lo, hi in local)
            if stored != math.prod(s["shape"]):
                raise CheckpointError(f"tensor {key}: pieces of {s['key']} in {s['file']} do not fill it")
        lo, hi = np.array(los, dtype=np.int64).reshape(-1, nd), np.array(his, dtype=np.int64).reshape(-1, nd)
        # the volume check first (cheap): pieces in bounds whose
        # volumes sum to the shape tile it iff none overlap
        total = int(np.prod(hi - lo, axis=1).sum()) if len(lo) else 0
        if total != math.prod(shape):
            raise CheckpointError(
                f"tensor {key}: pieces hold {total} elements of {math.prod(shape)} "
                f"({'a gap' if total < math.prod(shape) else 'an overlap'})"
            )
        if _overlaps(lo, hi):  # equal volume and no overlap: an exact tiling
            raise CheckpointError(f"tensor {key}: pieces overlap (and leave a gap)")


def _overlaps(lo: np.ndarray, hi: np.ndarray) -> bool:
    # sorted along dim 0, each piece is compared only with those starting before it ends there: not all pairs
    order = np.argsort(lo[:, 0], kind="stable") if len(lo) else []
    lo, hi = lo[order], hi[order]
    for i in range(len(lo)):  # against the later pieces starting before this one ends along dim 0
        j = np.searchsorted(lo[i + 1 :, 0], hi[i, 0], side="left")
        if j and np.any(np.all((lo[i + 1 : i + 1 + j] < hi[i]) & (hi[i + 1 : i + 1 + j] > lo[i]), axis=1)):
            return True
    return False


def read(path: str | Path) -> dict:
    """metadata.json of a checkpoint folder (v1 upgraded in memory); CheckpointError if unreadable."""
    try:
        meta = json.loads((Path(path) / "metadata.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable metadata.json ({e})") from e
    if not isinstance(meta, dict):  # valid JSON, but a list, a number or null: not a checkpoint's
        raise CheckpointError(f"{path}: metadata.json is not a checkpoint's (a JSON {type(meta).__name__})")
    if meta.get("format") == FORMAT_V1:
        try:
            return upgrade(meta)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise CheckpointError(f"{path}: metadata.json is damaged ({type(e).__name__}: {e})") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a megaframe checkpoint (format {meta.get('format')!r})")
    return _well_formed(path, meta)


def _well_formed(path, meta: dict) -> dict:
    """The fields every reader indexes have their types: damaged metadata is one CheckpointError naming
    the file, never a KeyError or AttributeError in a tool (resume, generate, verify) that reads it."""

    def bad(what: str):
        raise CheckpointError(f"{path}: metadata.json is damaged ({what})")

    if not isinstance(meta.get("step"), int) or isinstance(meta.get("step"), bool):
        bad(f"step {meta.get('step')!r}")
    for key in ("files", "tensors"):
        if not isinstance(meta.get(key), dict):
            bad(f"{key!r} is {type(meta.get(key)).__name__}, not an object")
    for name, f in meta["files"].items():
        if not isinstance(f, dict) or not isinstance(f.get("bytes"), int):
            bad(f"file entry {name!r}")
    for key, info in meta["tensors"].items():
        if (
            not isinstance(info, dict)
            or not isinstance(info.get("shards"), list)
            or not all(isinstance(s, dict) and isinstance(s.get("file"), str) for s in info["shards"])
        ):
            bad(f"tensor entry {key!r}")
        problem = _tensor_problem(info)
        if problem:  # the file, the tensor and the field: a reader would trip on it with no name at all
            bad(f"tensor {key!r}: {problem}")
    for key in ("config", "lineage"):
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            bad(f"{key!r} is not an object")
    for key, v in (meta.get("lineage") or {}).items():  # parent 5 was a TypeError in every lineage reader
        if key in LINEAGE_TEXT and v is not None and not isinstance(v, str):
            bad(f"lineage {key} {v!r}")
    name = Path(path).name
    # a step folder holds its own step: a hand-edited step 999 in step_00000006 resumed "at step 999"
    if name.startswith("step_") and name[5:].isdigit() and int(name[5:]) != meta["step"]:
        bad(f"step {meta['step']} in folder {name}")
    return meta


def _ints(v, n: int | None = None) -> bool:
    """A list of non-negative ints (of length n when given)."""
    return (
        isinstance(v, list)
        and (n is None or len(v) == n)
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
    )


def _box(v, ndim: int) -> bool:
    """[[lo, hi], ...] per dimension, lo <= hi."""
    return isinstance(v, list) and len(v) == ndim and all(_ints(r, 2) and r[0] <= r[1] for r in v)


def _tensor_problem(info: dict) -> str | None:
    """What is malformed in one tensor entry (dtype, global_shape, each shard's key, shape and pieces), else
    None. Checked here so that resume=auto passes a damaged checkpoint over like any other damage, and the
    tools say which field, instead of an AttributeError from getattr(torch, dtype) or a failed unpacking."""
    import torch

    for where, dtype in [("dtype", info.get("dtype"))] + [
        (f"shard {i} dtype", s["dtype"]) for i, s in enumerate(info["shards"]) if "dtype" in s
    ]:
        if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
            return f"{where} {dtype!r} is not a torch dtype"
    shape = info.get("global_shape")
    if not _ints(shape):
        return f"global_shape {shape!r} is not a list of sizes"
    for i, s in enumerate(info["shards"]):
        if not isinstance(s.get("key"), str) or not _ints(s.get("shape")):
            return f"shard {i} (in {s['file']}): key {s.get('key')!r} or shape {s.get('shape')!r}"
        pieces = s.get("pieces")
        if not isinstance(pieces, list) or not all(
            isinstance(p, list) and len(p) == 2 and _box(p[0], len(s["shape"])) and _box(p[1], len(shape))
            for p in pieces
        ):
            return (
                f"shard {i} (in {s['file']}): pieces {json.dumps(pieces)[:80]} "
                "are not [stored box, global box] pairs"
            )
    return None


LINEAGE_TEXT = ("id", "run_id", "parent", "parent_id", "owner", "run_dir")
"""The lineage entry's fields (checkpoint/lineage.py, runops/access/owner.py): each a string or null."""


def upgrade(meta: dict) -> dict:
    """A v1 metadata dict in v2 form: each shard's tensor stored whole under its logical key."""
    for key, info in meta["tensors"].items():
        shape, shards = info["global_shape"], []
        for s in info["shards"]:
            if s["dim"] is None:
                local = [[0, n] for n in shape]
                pieces = [[local, local]]
            else:
                d, size = s["dim"], sum(n for _, _, n in s["ranges"])
                local = [list(x) for x in ([0, n] for n in shape)]
                local[d] = [0, size]
                pieces = []
                for g, lo, n in s["ranges"]:
                    lb, gb = [list(x) for x in local], [list(x) for x in local]
                    lb[d], gb[d] = [lo, lo + n], [g, g + n]
                    pieces.append([lb, gb])
            shards.append({"file": s["file"], "key": key, "shape": [hi for _, hi in local], "pieces": pieces})
        info["shards"] = shards
    meta["v1_files"] = meta.get("files", {})
    return meta


def check_complete(path: str | Path) -> dict:
    """Metadata of a checkpoint that is committed with its coverage recorded and whose files are all
    present with their recorded sizes, decided without reading shard bytes; CheckpointError otherwise."""
    meta = read(path)
    # only a commit writes "exact", after check_coverage passed:
    # a metadata.json without it was not written by a commit
    if meta.get("format") == FORMAT and meta.get("coverage") != "exact":
        raise CheckpointError(f"{path}: metadata.json records no coverage check")
    files = meta.get("files", {})
    for name, want in files.items():
        f = confined(path, name)
        if not f.is_file():
            raise CheckpointError(f"{path}: shard {name} is missing")
        size = f.stat().st_size
        # a size check catches a truncated or missing write
        # without reading the data; the loads check the bytes
        if size != want["bytes"]:
            raise CheckpointError(f"{path}: shard {name} is corrupt ({size} bytes, expected {want['bytes']})")
    for key, info in meta["tensors"].items():
        for s in info["shards"]:
            if s["file"] not in files:
                raise CheckpointError(
                    f"{path}: tensor {key} names file {s['file']!r}, which the checkpoint does not list"
                )
    return meta


def committed(root: str | Path) -> list[Path]:
    """Committed step folders under root, oldest first."""
    if not Path(root).is_dir():
        return []
    return sorted(
        p
        for p in Path(root).glob("step_*")
        # only step_<digits>: a .tmp folder is a save in progress or a crashed one, a .replaced-...
        # folder another branch's checkpoint kept aside (sharded.commit); metadata.json is written
        # last, so its presence marks a commit
        if p.name[5:].isdigit() and p.is_dir() and (p / "metadata.json").is_file()
    )


POSITION_FIELDS = ("consumed_samples", "consumed_tokens", "data")
"""The fields a resume reads its sample position from (checkpoint/resume_checks.py): an edited one would make
the resumed run skip or repeat data without a sign, so the commit seals each one."""
SEAL_KEY = "position_sha256"


def _digest(value) -> str:
    # sorted keys, compact: the same for the dict the save wrote and the one a reader parses back
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed(meta: dict) -> dict:
    """`meta` with the sha256 of each of its POSITION_FIELDS, as the commit writes it."""
    return {**meta, SEAL_KEY: {k: _digest(meta[k]) for k in POSITION_FIELDS if k in meta}}


def position_problem(meta: dict) -> str | None:
    """Why the sealed position cannot be trusted (the first field whose value no longer matches the sha256
    the save recorded, with its value; or a seal that is not one), or None. Checkpoints written before the
    seal (none recorded) are taken at their word, as then."""
    seal = meta.get(SEAL_KEY)
    if seal is None:
        return None
    if not isinstance(seal, dict):
        return f"{SEAL_KEY} {json.dumps(seal)[:80]} is not the object of sha256s a save writes"
    for k in POSITION_FIELDS:
        if k in seal and (k not in meta or _digest(meta[k]) != seal[k]):
            return f"{k} {json.dumps(meta.get(k))[:80]} does not match the {SEAL_KEY} its save recorded"
    return None
