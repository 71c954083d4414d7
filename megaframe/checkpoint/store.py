"""Shard files: safetensors with a crc32 per fixed-size block of every tensor in the header, written
and fsynced whole; read back by byte ranges, each block checked as it is read.

The blocks let a rank check exactly what it reads: a read is widened to whole blocks (at most two
partial blocks per range), never to whole tensors or files. Block size per tensor: nbytes / 64 rounded
up to 256 B, capped at 64 KiB, so small tensors get fine blocks and big ones ~16 crcs per MiB.

Reads go through one staging buffer per file opened, of at most `staging_bytes` (STAGING_BYTES = 64 MiB unless
the caller says otherwise; never less than one block, 64 KiB, nor more than the file's largest read): a long
range is read, checked and handed on in chunks of that size, so the host memory a load needs beyond its
destinations is bounded by this buffer, whatever the size of the tensors (a copy into another device may stage
one more piece of a chunk on its way: at most twice the bound).
"""

from __future__ import annotations

import base64
import json
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from megaframe.checkpoint.metadata import CheckpointError, confined

CRC_KEY = "megaframe/crc32"
MAX_BLOCK = 64 << 10
STAGING_BYTES = 64 << 20
"""The default bound of a read's staging buffer (see the module docstring)."""


def block_size(nbytes: int) -> int:
    return max(256, min(MAX_BLOCK, -(-max(nbytes, 1) // 64 // 256) * 256))


def _bytes(t: torch.Tensor) -> memoryview:
    # a uint8 view: the crcs cover the stored bytes of any dtype (numpy has no bfloat16)
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def block_crcs(t: torch.Tensor) -> str:
    """ "<block size>:<base64 of the little-endian uint32 crc32 of each block>" (compact: the header is
    metadata every reader of the file reads)."""
    data = _bytes(t)
    b = block_size(len(data))
    # max(len, 1): an empty tensor still gets one crc (of no bytes), so every key has an entry
    crcs = np.array([zlib.crc32(data[i : i + b]) for i in range(0, max(len(data), 1), b)], dtype="<u4")
    return f"{b}:{base64.b64encode(crcs.tobytes()).decode()}"


def _parse_crcs(text: str) -> tuple[int, np.ndarray]:
    b, _, packed = text.partition(":")
    return int(b), np.frombuffer(base64.b64decode(packed), dtype="<u4")


def shard_name(rank: int) -> str:
    return f"shard_{rank:05d}.safetensors"


_UMASK = os.umask(0o022)  # read once at import (single-threaded): os.umask can only be read by setting it
os.umask(_UMASK)


def write_file(folder: Path, rank: int, tensors: dict[str, torch.Tensor], fail: str | None = None) -> dict:
    """Write and fsync shard_<rank>.safetensors; returns {"bytes", "header_crc32", "data_bytes"}.
    `fail` injects a fault for tests: "error" raises after a partial file, "kill" SIGKILLs this process
    in the middle of the write."""
    path = folder / shard_name(rank)
    crcs = {k: block_crcs(t) for k, t in tensors.items()}
    if fail == "kill":
        # leave a partial file behind, as a real killed write would: the commit must refuse it, not trip on it
        path.write_bytes(b"\0" * 1024)
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    if fail:
        _fail_like_a_full_disk(path, rank)
    save_file(
        {k: t.contiguous() for k, t in tensors.items()}, str(path), metadata={CRC_KEY: json.dumps(crcs)}
    )
    # safetensors creates 0600 files; a checkpoint is shared like any other output (the umask rules)
    os.chmod(path, 0o666 & ~_UMASK)
    with open(path, "rb") as f:
        # fsync before reporting ok: rank 0 commits on this report,
        # and a crash must not leave a commit without its data
        os.fsync(f.fileno())
        n = struct.unpack("<Q", f.read(8))[0]
        # recorded in metadata.json: a torn header is caught before its offsets are trusted
        header_crc = zlib.crc32(f.read(n))
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"bytes": path.stat().st_size, "header_crc32": header_crc, "data_bytes": data}


def _fail_like_a_full_disk(path: Path, rank: int) -> None:
    """The injected write failure is what safetensors raises on a full disk: its own SafetensorError (not
    an OSError) with the OS error in the text, after a partial temporary file (safetensors writes a hidden
    temporary file in the folder, then renames it), so the caller is tested against the real error type."""
    from safetensors import SafetensorError

    (path.parent / f".tmp{rank:05d}injected").write_bytes(b"\0" * 1024)
    raise SafetensorError(
        f"Error while serializing: I/O error: No space left on device (os error 28) "
        f"[injected write failure on rank {rank} ({path.name})]"
    )


@dataclass
class Header:
    data_start: int
    tensors: dict
    crcs: dict
    nbytes: int


def read_header(f, name: str, want_crc: int | None) -> Header:
    raw = f.read(8)
    if len(raw) < 8:
        raise CheckpointError(f"shard {name} is corrupt (no safetensors header)")
    n = struct.unpack("<Q", raw)[0]
    # a garbage length (a torn or overwritten file) must be
    # a corrupt shard, not a huge read or an OverflowError
    size = os.fstat(f.fileno()).st_size
    if n > size - 8:
        raise CheckpointError(f"shard {name} is corrupt (header length {n} exceeds the file's {size} bytes)")
    head = f.read(n)
    if want_crc is not None and zlib.crc32(head) != want_crc:
        raise CheckpointError(f"shard {name} is corrupt (its header does not match the recorded checksum)")
    try:
        info = json.loads(head)
        crcs = json.loads(info.get("__metadata__", {}).get(CRC_KEY, "{}"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"shard {name} is corrupt (unreadable header: {e})") from e
    info.pop("__metadata__", None)
    return Header(8 + n, info, crcs, 8 + n)


@dataclass
class ReadStats:
    bytes: int = 0
    """All bytes read: shard headers (metadata) and tensor data."""
    data_bytes: int = 0
    files: int = 0
    opened: list = field(default_factory=list)


_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "F64": torch.float64,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_ranges(
    folder: Path,
    name: str,
    reads: list,
    want_crc: int | None,
    stats: ReadStats,
    check: bool = True,
    staging_bytes: int = STAGING_BYTES,
):
    """Open `name` once and yield (stored key, first element, tensor of elements [first, first + n)) covering
    each (stored key, first, last) in `reads` in order, in chunks of at most `staging_bytes`, reading only the
    blocks those ranges touch, each block checked against its crc32. CheckpointError names the file and tensor
    of a mismatch. The tensor yielded is a view of the staging buffer: valid until the next one is asked for
    (copy it out)."""
    path = confined(folder, name)
    with open(path, "rb") as f:
        stats.files += 1
        stats.opened.append(name)
        head = read_header(f, name, want_crc)
        stats.bytes += head.nbytes
        spans = [_span(head, name, r, check) for r in reads]
        # one buffer for the whole file: the largest chunk any of its reads needs, never more than the bound
        size = max([min(hi - lo, _step(unit, staging_bytes)) for _, _, _, lo, hi, unit, _ in spans] + [0])
        stage = torch.empty(size, dtype=torch.uint8)
        for (key, first, last), (dtype, begin, crc, a0, b0, unit, item) in zip(reads, spans):
            step = _step(unit, staging_bytes)
            for c0 in range(a0, b0, step):
                c1 = min(c0 + step, b0)
                buf = _pread(f.fileno(), stage[: c1 - c0], begin + c0, name, key)
                stats.bytes += c1 - c0
                stats.data_bytes += c1 - c0
                if crc is not None:
                    for at in range(c0, c1, unit):
                        if zlib.crc32(buf[at - c0 : at - c0 + unit]) != int(crc[at // unit]):
                            raise CheckpointError(
                                f"shard {name} is corrupt: tensor {key}, bytes "
                                f"{at}..{min(at + unit, c1)} fail their checksum"
                            )
                # the wanted part of this chunk: the range's ends may lie inside the first and last blocks
                x, y = max(first * item, c0), min(last * item, c1)
                yield key, x // item, stage[x - c0 : y - c0].view(dtype)


def _step(unit: int, staging_bytes: int) -> int:
    """Chunk size: whole units (crc blocks, or elements), at most staging_bytes, at least one unit."""
    return max(unit, staging_bytes // unit * unit)


def _span(head: Header, name: str, read: tuple, check: bool) -> tuple:
    """(dtype, first byte of the tensor in the file, crcs or None, [a0, b0) bytes of the tensor to read, chunk
    unit, element size) of one (stored key, first, last) read: widened to whole crc blocks when checked."""
    key, first, last = read
    t = head.tensors.get(key)
    if t is None:
        raise CheckpointError(f"shard {name} has no tensor {key}")
    dtype = _DTYPES[t["dtype"]]
    item = torch.empty((), dtype=dtype).element_size()
    a, b = first * item, last * item
    nbytes = t["data_offsets"][1] - t["data_offsets"][0]
    # a header that disagrees with metadata.json: never a short read that leaves elements unread
    if b > nbytes:
        raise CheckpointError(
            f"shard {name} is corrupt (tensor {key} holds {nbytes} bytes, the metadata needs {b})"
        )
    crc = _parse_crcs(head.crcs[key]) if check and key in head.crcs else None
    if crc is None:
        return dtype, head.data_start + t["data_offsets"][0], None, a, b, item, item
    blk, crc = crc
    # widened to whole blocks so each one can be checked against its crc; a tensor's last block may be short
    return (
        dtype,
        head.data_start + t["data_offsets"][0],
        crc,
        a // blk * blk,
        min(-(-b // blk) * blk, nbytes),
        blk,
        item,
    )


def _pread(fd: int, into: torch.Tensor, offset: int, name: str, key: str) -> memoryview:
    """Fill `into` (uint8) with the file's bytes at offset; CheckpointError when the file ends first."""
    view = memoryview(into.numpy())
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise CheckpointError(f"shard {name} is corrupt (tensor {key} is cut short)")
        got += n
    return view


def verify_file(folder: Path, name: str, want: dict) -> None:
    """Every byte of one shard file against its checksums (offline verification)."""
    path = confined(folder, name)
    with open(path, "rb") as f:
        head = read_header(f, name, want.get("header_crc32"))
        reads = [(k, 0, int(np.prod(t["shape"]))) for k, t in head.tensors.items()]
    for _ in read_ranges(folder, name, reads, want.get("header_crc32"), ReadStats()):
        pass
