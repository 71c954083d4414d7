"""Ring attention over the cp group (parallel.cp_comm=ring, Megatron's p2p context parallelism).

Each cp rank keeps its own K/V block; the blocks travel around the ring (rank r sends to r+1, receives
from r-1), one exchange per step, issued before the block attention of the step so the transfer overlaps
it. Partial results are merged by log-sum-exp, so only two K/V blocks (the one in use, the one arriving)
are held at a time. Backward runs the ring again: the K/V block travels with its dK/dV accumulator, and
one last exchange returns each accumulator to its owner. The mask compares global positions
(context.cp_positions), as the all-gather variant does: exact causal attention.

Attention dropout (model.dropout > 0, training): the keep mask of this rank's queries against the whole
gathered sequence, [B, H, Q, c·N] in cp-rank order, is drawn up front exactly as the all-gather path's
SDPA draws it (one `bernoulli_` of a tensor of that shape and dtype from the default generator, the
math kernel's draw on CPU), and block `src` uses its columns src·N..(src+1)·N. So on CPU the ring gives
the all-gather path's dropout results and leaves the generator where SDPA would (later draws agree);
on CUDA SDPA's fused kernels draw their own Philox masks, so the two paths agree in distribution only.
No mask is held between forward and backward: backward draws it again from the generator state saved
at the forward's draw (one more bernoulli_ per layer; a Q x c·N bool mask lives only inside each pass).
The dropped probabilities do not change the normaliser: o = Σ_b (P_b ⊙ D_b) V_b with P from the
final log-sum-exp, so the online merge is unchanged; in backward dP is masked too and
delta = rowsum(dO ⊙ O) still equals rowsum(P ⊙ dP) (FlashAttention's identity, dropout included).

Legend: B batch, H query heads, K kv heads, Q this rank's tokens, N the tokens of one K/V block, T = c·N
the gathered tokens, E head dim. Math in fp32 (the probabilities are recomputed in backward from the
saved log-sum-exp).

Query rows are processed in tiles (TILE_ELEMS) so the math's working memory stays bounded.
`overlap=False` (an internal switch for benchmarks/bench_cp.py, not a config key) issues each exchange after
the block's attention instead of before it and waits for it at once: the same bytes and results, with
the transfer on the critical path, so the bench shows what the overlap saves.
"""

from __future__ import annotations

import torch

from megaframe.parallel import comm
from megaframe.parallel.context import cp_keep, cp_positions
from megaframe.parallel.eager import eager
from megaframe.parallel.mesh import Axis
from megaframe.parallel.ring_fused import FusedRing, fold_heads, fused_kernels


def _exchange(axis: Axis, x: torch.Tensor) -> tuple[torch.Tensor, list]:
    """Send x to the next ring rank, receive the previous one's; returns (buffer, works to wait)."""
    buf = torch.empty_like(x)
    nxt, prv = (axis.rank + 1) % axis.size, (axis.rank - 1) % axis.size
    return buf, comm.batch_isend_irecv(axis, [(x.contiguous(), nxt)], [(buf, prv)])


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _expand(x_BKNE: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: kv head k serves query heads k·g .. k·g+g-1 (SDPA's enable_gqa order)."""
    return x_BKNE.repeat_interleave(heads // x_BKNE.shape[1], dim=1)


def _kept(keep_BHQT: torch.Tensor | None, t: slice, src: int, n: int, p: float) -> torch.Tensor | None:
    """Block src's dropout factors for query rows t
    (0 or 1/(1-p), fp32, as SDPA scales); None without dropout."""
    if keep_BHQT is None:
        return None
    return keep_BHQT[:, :, t, src * n : (src + 1) * n].float().div_(1 - p)


def _visible(
    pos_q: torch.Tensor,
    pos_k: torch.Tensor,
    t: slice,
    docq_BQ: torch.Tensor | None,
    dock_BN: torch.Tensor | None,
) -> torch.Tensor:
    """mask_QN (True = attend) of query rows t against one K/V block: causal by global position, and under
    document masking also the same document (then mask_B1QN). A row may see no key of a block (a later
    document's query against an earlier one's block): the merges below keep such rows at -inf, not NaN."""
    mask_QN = pos_k[None, :] <= pos_q[t, None]
    if docq_BQ is None:
        return mask_QN
    return (mask_QN & (docq_BQ[:, t, None] == dock_BN[:, None, :])).unsqueeze(1)


def _docs(doc_BS: torch.Tensor | None, c: int, rank: int) -> torch.Tensor | None:
    """The document ids of cp rank `rank`'s tokens (its two chunks); None without document masking."""
    return None if doc_BS is None else cp_keep(doc_BS, rank, c)


TILE_ELEMS = {"cpu": 1 << 20, "cuda": 1 << 26}
"""Score elements ([B, H, rows, N] fp32) one tile of query rows works on: the block attention is math, so
its scores, probabilities and their grads are working memory; tiling the rows bounds it (4 MiB a tensor
on CPU, 256 MiB on GPU) instead of [B, H, S/c, S/c], which at long S outweighs all the saved activations."""


def _tiles(q_BHQE: torch.Tensor, n: int, elems: int | None) -> list[slice]:
    b, h, rows = q_BHQE.shape[:3]
    step = max(1, (elems or TILE_ELEMS.get(q_BHQE.device.type, 1 << 22)) // max(1, b * h * n))
    return [slice(a, min(a + step, rows)) for a in range(0, rows, step)]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q_BHQE,
        k_BKNE,
        v_BKNE,
        axis: Axis,
        seq: int,
        overlap: bool,
        tile: int | None,
        dropout_p: float,
        doc_BS: torch.Tensor | None,
    ):
        c, r, h, n = axis.size, axis.rank, q_BHQE.shape[1], k_BKNE.shape[2]
        docq_BQ = _docs(doc_BS, c, r)
        ctx.rng = _rng_state(q_BHQE.device) if dropout_p > 0 else None  # backward draws the mask again
        keep_BHQT = dropout_keep(q_BHQE, c * n, dropout_p) if dropout_p > 0 else None
        scale = q_BHQE.shape[-1] ** -0.5
        pos_q = cp_positions(seq, c, r, q_BHQE.device)
        q = q_BHQE.float()
        o = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        kv = torch.stack([k_BKNE, v_BKNE])
        tiles = _tiles(q, k_BKNE.shape[2], tile)
        for j in range(c):
            works = []
            if j < c - 1 and overlap:  # the next block's transfer overlaps this block's attention
                nxt, works = _exchange(axis, kv)
            pos_k, dock_BN = cp_positions(seq, c, (r - j) % c, q.device), _docs(doc_BS, c, (r - j) % c)
            k, v = _expand(kv[0].float(), h), _expand(kv[1].float(), h)
            for t in tiles:  # rows are independent: each tile merges its block into its own rows of o, lse
                mask_QN = _visible(pos_q, pos_k, t, docq_BQ, dock_BN)
                s = ((q[:, :, t] @ k.transpose(-1, -2)) * scale).masked_fill(~mask_QN, float("-inf"))
                new_lse = torch.logaddexp(lse[:, :, t], torch.logsumexp(s, dim=-1))
                seen = torch.isfinite(new_lse)  # rows with no visible key yet keep 0
                ref = new_lse.where(seen, 0)
                p = torch.where(seen[..., None], torch.exp(s - ref[..., None]), 0.0)
                keep = torch.where(seen, torch.exp(lse[:, :, t] - ref), 0.0)
                drop = _kept(keep_BHQT, t, (r - j) % c, n, dropout_p)
                o[:, :, t] = o[:, :, t] * keep[..., None] + (p if drop is None else p * drop) @ v
                lse[:, :, t] = new_lse
            if j < c - 1 and not overlap:
                nxt, works = _exchange(axis, kv)
            _wait(works)
            if j < c - 1:
                kv = nxt
        ctx.save_for_backward(q_BHQE, k_BKNE, v_BKNE, o, lse, doc_BS)
        ctx.axis, ctx.seq, ctx.overlap, ctx.tile, ctx.dropout_p = axis, seq, overlap, tile, dropout_p
        return o.to(q_BHQE.dtype)

    @staticmethod
    def backward(ctx, do_BHQE):
        q_BHQE, k_BKNE, v_BKNE, o, lse, doc_BS = ctx.saved_tensors
        axis, seq = ctx.axis, ctx.seq
        c, r, h, groups, n = axis.size, axis.rank, q_BHQE.shape[1], k_BKNE.shape[1], k_BKNE.shape[2]
        docq_BQ = _docs(doc_BS, c, r)
        scale = q_BHQE.shape[-1] ** -0.5
        pos_q = cp_positions(seq, c, r, q_BHQE.device)
        keep_BHQT = None
        if ctx.rng is not None:  # the forward's mask, drawn again from the generator state it started from
            keep_BHQT = dropout_keep(q_BHQE, c * n, ctx.dropout_p, _generator_at(ctx.rng, q_BHQE.device))
        q, do = q_BHQE.float(), do_BHQE.float()
        delta = (do * o).sum(-1)
        ref = lse.where(torch.isfinite(lse), 0)
        dq = torch.zeros_like(q)
        kv = torch.stack([k_BKNE, v_BKNE])
        dkv = torch.zeros_like(kv, dtype=torch.float32)
        tiles = _tiles(q, k_BKNE.shape[2], ctx.tile)
        for j in range(c):
            works = []
            if j < c - 1 and ctx.overlap:  # the K/V block moves on while its grads are computed here
                nxt, works = _exchange(axis, kv)
            pos_k, dock_BN = cp_positions(seq, c, (r - j) % c, q.device), _docs(doc_BS, c, (r - j) % c)
            k, v = _expand(kv[0].float(), h), _expand(kv[1].float(), h)
            dk, dv = torch.zeros_like(k), torch.zeros_like(v)
            for t in tiles:
                mask_QN = _visible(pos_q, pos_k, t, docq_BQ, dock_BN)
                s = ((q[:, :, t] @ k.transpose(-1, -2)) * scale).masked_fill(~mask_QN, float("-inf"))
                p = torch.exp(s - ref[:, :, t, None]).masked_fill(~mask_QN, 0.0)
                dp = do[:, :, t] @ v.transpose(-1, -2)
                drop = _kept(keep_BHQT, t, (r - j) % c, n, ctx.dropout_p)
                if drop is not None:  # o = (P ⊙ D) V: dP and dV see the dropped probabilities
                    dp = dp * drop
                ds = p * (dp - delta[:, :, t, None]) * scale
                dq[:, :, t] += ds @ k
                dk += ds.transpose(-1, -2) @ q[:, :, t]
                dv += (p if drop is None else p * drop).transpose(-1, -2) @ do[:, :, t]
            dkv = dkv + torch.stack([fold_heads(dk, groups), fold_heads(dv, groups)])
            if j < c - 1 and not ctx.overlap:
                nxt, works = _exchange(axis, kv)
            _wait(works)
            # the accumulator follows its block: after c-1 moves it sits one rank behind its owner, and
            # one more move (below) brings it home
            moved, w2 = _exchange(axis, dkv)
            _wait(w2)
            dkv = moved
            if j < c - 1:
                kv = nxt
        return dq.to(q_BHQE.dtype), dkv[0].to(k_BKNE.dtype), dkv[1].to(v_BKNE.dtype), *[None] * 6


def _rng_state(device: torch.device) -> torch.Tensor:
    """The state of the generator dropout_keep draws from on `device`."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _generator_at(state: torch.Tensor, device: torch.device) -> torch.Generator:
    """A generator of its own at `state`: the backward draws the forward's mask again without touching the
    default one, which a forward running beside it on another thread draws from (the overlapped pipeline
    kinds, pipeline/overlap.py; setting and restoring the default generator there moved that forward's
    masks)."""
    gen = torch.Generator(device)
    gen.set_state(state)
    return gen


def dropout_keep(
    q_BHQE: torch.Tensor, gathered: int, p: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The attention-dropout keep mask (True = kept) of this rank's queries against `gathered` tokens,
    drawn as SDPA's math kernel draws it for the all-gather path: one bernoulli_ of a [B, H, Q, T] tensor
    of the queries' dtype from the default generator (same values, same generator state after), or from
    `generator`."""
    b, h, q = q_BHQE.shape[:3]
    keep = torch.empty(b, h, q, gathered, dtype=q_BHQE.dtype, device=q_BHQE.device)
    return keep.bernoulli_(1 - p, generator=generator).bool()


@eager  # p2p inside: eager between a compiled block's pieces (as comm/'s collectives)
def ring_attention(
    q_BHQE: torch.Tensor,
    k_BKNE: torch.Tensor,
    v_BKNE: torch.Tensor,
    axis: Axis,
    seq: int,
    overlap: bool = True,
    tile_elems: int | None = None,
    dropout_p: float = 0.0,
    fused: bool = True,
    doc_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact causal attention of this rank's queries against the whole cp group's K/V, by ring, with
    attention dropout when dropout_p > 0 (see the module docstring).
    Without dropout, where the device has them (ring_fused.fused_kernels), each block runs on fused
    flash kernels merged by log-sum-exp (ring_fused.py); else, and with `fused=False` (an internal switch
    for benchmarks/bench_cp.py and tests), on the fp32 math below.
    `tile_elems`: the math's score elements per tile of query rows (None: TILE_ELEMS of the device; tests
    set a small one to cross tile boundaries on tiny shapes).
    `doc_BS` (document masking): the whole sample's document ids in global order; each block is masked by
    its tokens' documents as well (the fused kernels take the mask on CPU; CUDA's flash takes none, so
    there the math ring runs)."""
    if fused and dropout_p == 0 and fused_kernels(q_BHQE) and (doc_BS is None or not q_BHQE.is_cuda):
        return FusedRing.apply(q_BHQE, k_BKNE, v_BKNE, axis, overlap, _exchange, _wait, doc_BS)
    return _RingAttention.apply(q_BHQE, k_BKNE, v_BKNE, axis, seq, overlap, tile_elems, dropout_p, doc_BS)
