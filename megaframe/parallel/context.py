"""Context parallelism (parallel.cp = c): each sequence is cut into 2c chunks along S and cp rank i keeps
chunks i and 2c-1-i, so every rank holds one early and one late chunk and causal attention work is
balanced (torchtitan's head-tail / Megatron's load balancing). Tokens, labels and positions all follow
the same cut; the model sees the global position of every kept token (RoPE angles, learned rows).

Attention (cp_comm=allgather, Llama 3's choice): K and V of the cp group are all-gathered along S in
cp-rank order (comm.gather_from_cp), so the gathered sequence is rank 0's two chunks, rank 1's, ...;
`cp_positions(S, c, r)` for each r gives their global positions, and the causal mask compares global
positions: exact, whatever the order.

Legend: B batch, S sequence (S/c on a cp rank), Q this rank's query tokens, T the gathered K/V tokens.
"""

from __future__ import annotations

import functools

import torch


def cp_positions(seq: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of the tokens cp rank `rank` keeps of a length-`seq` sequence: chunks rank and
    2cp-1-rank, in that order."""
    n = seq // (2 * cp)
    first = torch.arange(rank * n, (rank + 1) * n, device=device)
    second = torch.arange((2 * cp - 1 - rank) * n, (2 * cp - rank) * n, device=device)
    return torch.cat([first, second])


def cp_keep(x_BS: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    """This cp rank's chunks of every sequence (dim 1); x itself when cp = 1."""
    if cp == 1:
        return x_BS
    n = x_BS.shape[1] // (2 * cp)
    return torch.cat(
        [x_BS[:, rank * n : (rank + 1) * n], x_BS[:, (2 * cp - 1 - rank) * n : (2 * cp - rank) * n]], dim=1
    )


def cp_merge(parts_BS: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of cp_keep: the whole sequences from every cp rank's kept chunks (rank order)."""
    cp = len(parts_BS)
    n = parts_BS[0].shape[1] // 2
    chunks = [None] * (2 * cp)
    for r, part in enumerate(parts_BS):
        chunks[r], chunks[2 * cp - 1 - r] = part[:, :n], part[:, n:]
    return torch.cat(chunks, dim=1)


def cp_causal_mask(seq: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """mask_QT (True = attend) of this rank's queries against the gathered K/V of the whole cp group."""
    q_Q = cp_positions(seq, cp, rank, device)
    k_T = torch.cat([cp_positions(seq, cp, r, device) for r in range(cp)])
    return k_T[None, :] <= q_Q[:, None]


def cp_runs(seq: int, cp: int, rank: int, blocks: int = 1, block: int = 0) -> list[tuple[int, int, int]]:
    """Runs of consecutive global positions among the rows a rank holds, in its local order: cp rank
    `rank`'s two chunks of a length-`seq` sequence, cut into `blocks` equal blocks of which the rank holds
    block `block` (sequence parallelism over tp). Always two runs, (local lo, local hi, global start); a
    block inside one chunk gets an empty second (or first) run."""
    if cp == 1:  # one run (the sequence need not split into two chunks: an odd length under sp)
        m = seq // blocks
        return [(0, m, block * m), (m, m, seq)]
    n = seq // (2 * cp)
    m = 2 * n // blocks  # rows of one block
    lo = block * m  # the block's first row in the rank's two chunks
    split = min(max(n - lo, 0), m)  # block rows from the first chunk
    return [(0, split, rank * n + lo), (split, m, (2 * cp - 1 - rank) * n + max(lo - n, 0))]


@functools.lru_cache(maxsize=16)
def cp_causal_bias(seq: int, cp: int, rank: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """bias_QT: the additive form of cp_causal_mask (0 attend, -inf not) in the attention dtype, one tensor
    shared by every layer. Handed a bool mask, SDPA's kernels (CPU flash, CUDA memory-efficient) convert
    it to exactly this on every call and save the copy for backward: a [Q, T] tensor per layer, more than
    all the layer's other activations at long S. A float bias is saved by reference. Cached (a derived
    constant of the layout, like the RoPE tables) so the layers share one copy."""
    mask_QT = cp_causal_mask(seq, cp, rank, device)
    return torch.zeros(mask_QT.shape, dtype=dtype, device=device).masked_fill_(~mask_QT, float("-inf"))


def cp_bytes_per_layer(
    seq: int,
    cp: int,
    micro_batch: int,
    kv_heads: int,
    head_dim: int,
    elem_bytes: int,
    ring: bool,
    recompute: str = "none",
) -> int:
    """Bytes one cp rank sends on the cp axis for one transformer layer and one micro-batch, forward and
    backward (the theory comm_bytes/cp is checked against, and the planner's figure). kv_heads: this tp
    rank's. A rank's K (or V) block is S/c x B x K x E elements.
      allgather: forward all-gathers K and V, (c-1) blocks each; backward reduce-scatters their grads,
                 (c-1)/c of the gathered c blocks each: the same bytes.
      ring:      forward passes the K/V pair c-1 times; backward passes it c-1 times again, plus the
                 travelling fp32 dK/dV pair c times (the last move brings it home).
    Recompute re-runs the forward exchange in backward: full recompute re-runs the block (both kinds);
    selective re-runs the attention core, which holds the ring but not the all-gather; op_selective re-runs
    every op of the block but the kept ones, the exchange included (both kinds)."""
    if cp == 1:
        return 0
    block = seq // cp * micro_batch * kv_heads * head_dim
    fwd = 2 * (cp - 1) * block * elem_bytes
    bwd = fwd + (2 * cp * block * 4 if ring else 0)
    reruns = recompute in ("full", "op_selective") or (ring and recompute == "selective")
    return fwd * (2 if reruns else 1) + bwd
