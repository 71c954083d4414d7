"""The per-epoch sample order as a keyed bijection of [0, N), computed per position in O(1) memory.

A balanced Feistel network over 2·h bits (2^(2h) >= N, so the domain is under 4N) permutes the domain;
values >= N are walked through the network again ("cycle walking") until they land in [0, N), which
keeps it a bijection of [0, N). Each round's function is a splitmix64 finaliser of (round key, half);
the round keys come from (seed, epoch). No array of samples is ever built: a 1.8 G-sample corpus costs
the same few hundred bytes as a tiny one.

ORDER names this order in checkpoints; LEGACY is the order of runs begun before it (a materialised
numpy permutation per epoch), still produced for a run resumed from such a checkpoint so it keeps the
order it started with.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np

ORDER = "feistel-v1"
LEGACY = "numpy-permutation-v0"
ROUNDS = 6  # a Feistel network is a strong pseudorandom permutation from 4 rounds (Luby-Rackoff)
_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a cheap 64-bit avalanche."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


@lru_cache(maxsize=64)
def _keys(seed: int, epoch: int) -> tuple[int, ...]:
    # sha256, not hash(): Python salts hash() per process,
    # and every rank and every resume must get the same keys
    digest = hashlib.sha256(f"megaframe-order/{seed}/{epoch}".encode()).digest()
    # overlapping 8-byte windows: six 64-bit keys from one 32-byte digest
    return tuple(int.from_bytes(digest[4 * r : 4 * r + 8], "little") for r in range(ROUNDS))


def _half_bits(n: int) -> int:
    # 2h >= the bits of n - 1, so 2^(2h) < 4n: cycle walking passes the network under 4 times on average
    return max(1, ((n - 1).bit_length() + 1) // 2)


def feistel_index(offset: int, n: int, seed: int, epoch: int) -> int:
    """The sample at `offset` of epoch `epoch`'s order of n samples."""
    if n <= 1:
        return 0
    h = _half_bits(n)
    mask = (1 << h) - 1
    keys = _keys(seed, epoch)
    x = offset
    while True:  # cycle walking: under 4 passes on average, since the domain is < 4n
        left, right = x >> h, x & mask
        for k in keys:
            left, right = right, left ^ (_mix(k ^ right) & mask)
        x = (left << h) | right
        if x < n:
            return x


@lru_cache(maxsize=16)  # LEGACY only: one per dataset and split in use
def _epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 0x5EED]).permutation(num_samples)


def sample_index(position: int, num_samples: int, seed: int, order: str = ORDER) -> int:
    """Sample id at a global position in the run's sample stream (layout-free)."""
    epoch, offset = divmod(int(position), num_samples)
    if order == ORDER:
        return feistel_index(offset, num_samples, seed, epoch)
    if order == LEGACY:
        return int(_epoch_permutation(num_samples, seed, epoch)[offset])
    raise ValueError(f"unknown data order {order!r} (this version knows {ORDER!r} and {LEGACY!r})")


def resumed_order(meta: dict) -> str:
    """The order a checkpointed run was using: the recorded one, else LEGACY for a run begun before ORDER
    existed, else ORDER for a checkpoint that never drew a sample (an HF import, old or new: nothing to
    keep)."""
    data = meta.get("data") or {}
    if "order" in data:
        return data["order"]
    drew = data.get("consumed_samples", meta.get("consumed_samples", 0)) and "imported_from" not in meta
    return LEGACY if drew else ORDER
