"""Document masking (`data.document_mask=true`): each token attends only within its own document, and
positions restart at every document, as if each document had been run alone (Llama 3 at 8k context;
torchtitan's block masks).

Legend: B batch, S the whole sample, Q this rank's query tokens (S, or S/c under context parallelism;
under sp attention sees the gathered sequence), T the keys attention sees at once (S; under
cp_comm=allgather the cp group's gathered K/V: in cp-rank order for SDPA, put in global order for flex),
E head dim.

A sample is a window of the concatenated token stream; a document ends at its end-of-document token, which
belongs to the document it ends. So doc_BS[t] = the number of end tokens before t, and the position of t
is t minus the first index of its document. The ids come from the micro-batch's input ids, on every
pipeline stage (the executor hands each stage its micro-batch), so every layout derives the same mask.

Context parallelism: a cp rank is given only its two chunks of the sample (context.cp_keep), but a
token's document and position depend on every end token before it, which may sit on another cp rank
(a document that starts in chunk 0 and runs into chunk 3). So the cp group all-gathers which of its
tokens end a document (one byte a token, once per micro-batch and pipeline chunk: B·S/c bytes against
the per-layer K/V all-gather's 2·B·S/c·K·E·2) and every rank derives the whole sample's document ids
and positions. Sending the flags rather than deriving them from more input ids keeps the data loader's
contract (a rank reads only its own chunks) and costs less than shipping the ids themselves.

The loss is left as it is: the end token's label is the next document's first token, predicted from
the ended document alone (as torchtitan and Megatron do; nothing of the next document leaks into it).

Kernels (DocContext.kernel, chosen by the model):
  "sdpa" (CPU, the reference; and CUDA with attention dropout): a boolean [B, 1, Q, T] mask to SDPA.
  "flex" (CUDA): FlexAttention with a BlockMask built from the document ids: no [Q, T] tensor, and the
    blocks a query block cannot see (other documents, the future) are skipped (docs/data.md says why).
  "ring" (cp_comm=ring): no mask tensor; ring_attention masks each K/V block by its documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaframe.parallel import comm
from megaframe.parallel.context import cp_keep, cp_merge, cp_positions
from megaframe.parallel.mesh import Axis

FLEX_BLOCK = 128
"""FlexAttention's block (tokens a side): the block mask holds one entry per [128, 128] tile."""


@dataclass
class DocContext:
    """What attention and the position embeddings need of a micro-batch's documents."""

    pos_BQ: torch.Tensor
    """Each of this rank's tokens' position within its own document."""
    doc_BS: torch.Tensor
    """The whole sample's document ids, in global order (the ring masks each K/V block with its part)."""
    kernel: str
    """"sdpa" | "flex" | "ring" (module docstring)."""
    mask_B1QT: torch.Tensor | None = None
    """sdpa: True where query q may attend key t (causal by global position, same document)."""
    block_mask: object = None
    """flex: the torch.nn.attention.flex_attention.BlockMask of the same rule."""


def _whole_sample_ends(ends_BQ: torch.Tensor, cp: Axis | None) -> torch.Tensor:
    """ends_BS of the whole sample from this rank's chunks' (an all-gather of one byte a token over cp)."""
    if cp is None or cp.size == 1:
        return ends_BQ
    gathered_XB = comm.all_gather_dim0(ends_BQ.t().to(torch.uint8).contiguous(), cp)  # cp-rank order
    return cp_merge(list(gathered_XB.t().bool().chunk(cp.size, dim=1)))


def document_context(
    ids_BQ: torch.Tensor, eos_ids: torch.Tensor, cp: Axis | None = None, kernel: str = "sdpa"
) -> DocContext:
    """Document ids from the end tokens (any id in eos_ids ends a document), positions and the mask of
    the kernel. ids_BQ: this rank's tokens (its two cp chunks under cp, context.cp_keep)."""
    c, r = (cp.size, cp.rank) if cp is not None else (1, 0)
    ends_BS = _whole_sample_ends(torch.isin(ids_BQ, eos_ids), cp).long()
    doc_BS = torch.cumsum(ends_BS, dim=1) - ends_BS  # an end token belongs to the document it ends
    s = ends_BS.shape[1]
    idx_S = torch.arange(s, device=ids_BQ.device)
    # first index of each token's document: the running max of "an end token just before"
    starts_BS = torch.where(torch.nn.functional.pad(ends_BS[:, :-1], (1, 0)).bool(), idx_S, 0)
    first_BS = torch.cummax(starts_BS, dim=1).values
    ctx = DocContext(cp_keep(idx_S - first_BS, r, c), doc_BS, kernel)
    if kernel == "ring":
        return ctx
    qpos_Q, qdoc_BQ = cp_positions(s, c, r, ids_BQ.device), cp_keep(doc_BS, r, c)
    if kernel == "flex":  # keys in global order (attention reorders the gathered K/V): whole tiles skip
        ctx.block_mask = doc_block_mask(qpos_Q, idx_S, qdoc_BQ, doc_BS)
    else:  # keys in the order of the all-gather: the cp group's chunks in cp-rank order
        kpos_T = torch.cat([cp_positions(s, c, j, ids_BQ.device) for j in range(c)]) if c > 1 else idx_S
        kdoc_BT = torch.cat([cp_keep(doc_BS, j, c) for j in range(c)], dim=1) if c > 1 else doc_BS
        same_BQT = qdoc_BQ[:, :, None] == kdoc_BT[:, None, :]
        ctx.mask_B1QT = (same_BQT & (kpos_T[None, :] <= qpos_Q[:, None])).unsqueeze(1)
    return ctx


def doc_block_mask(qpos_Q: torch.Tensor, kpos_T: torch.Tensor, qdoc_BQ: torch.Tensor, kdoc_BT: torch.Tensor):
    """FlexAttention's BlockMask of 'key at or before the query, same document' (compiled on CUDA: the
    mask function is evaluated block by block without an [Q, T] tensor; eager elsewhere, for the CPU test)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_doc_causal(b, h, q, k):
        return (kpos_T[k] <= qpos_Q[q]) & (qdoc_BQ[b, q] == kdoc_BT[b, k])

    b, q, t = qdoc_BQ.shape[0], qpos_Q.shape[0], kpos_T.shape[0]
    dev = qdoc_BQ.device
    if dev.type == "meta":  # the planner: the mask's tensors by shape (create_block_mask reads values)
        return MetaBlockMask(b, q, t, (qpos_Q, kpos_T, qdoc_BQ, kdoc_BT))
    return create_block_mask(
        same_doc_causal, b, None, q, t, device=dev, BLOCK_SIZE=FLEX_BLOCK, _compile=dev.type == "cuda"
    )


def block_mask_bytes(b: int, q: int, t: int) -> int:
    """Bytes of a BlockMask of b samples, q queries, t keys (one head row, FLEX_BLOCK tiles): int32 counts
    and indices of the partial and the full tiles, per query block (kv_*) and per key block (q_*, for
    backward): 4 · b · 2 · (QB + KB + 2·QB·KB). The [Q, T] mask itself is never built."""
    qb, kb = -(-q // FLEX_BLOCK), -(-t // FLEX_BLOCK)
    return 8 * b * (qb + kb + 2 * qb * kb)


class MetaBlockMask:
    """The planner's stand-in for a BlockMask on the meta device: its tensors' shapes, no values."""

    def __init__(self, b: int, q: int, t: int, buffers: tuple[torch.Tensor, ...]):
        qb, kb = -(-q // FLEX_BLOCK), -(-t // FLEX_BLOCK)
        shapes = [(b, 1, qb), (b, 1, qb, kb), (b, 1, kb), (b, 1, kb, qb)] * 2
        self.tensors = [torch.empty(sh, dtype=torch.int32, device="meta") for sh in shapes]
        self.buffers = buffers  # what the mask function reads (flex saves them for backward too)


class _FlexSizes(torch.autograd.Function):
    """Shape-only flex_attention for the planner: saves what the kernel saves for backward (q, k, v, the
    output, the fp32 row log-sum-exp, the block mask's tensors and the mask function's buffers)."""

    @staticmethod
    def forward(ctx, q_BHQE, k_BKTE, v_BKTE, *mask_tensors):
        out_BHQE = torch.empty_like(q_BHQE)
        lse_BHQ = torch.empty(q_BHQE.shape[:-1], dtype=torch.float32, device=q_BHQE.device)
        ctx.save_for_backward(q_BHQE, k_BKTE, v_BKTE, out_BHQE, lse_BHQ, *mask_tensors)
        return out_BHQE

    @staticmethod
    def backward(ctx, g):  # pragma: no cover - planning never runs backward
        raise RuntimeError("the planner's flex stand-in has no backward")


def doc_flex_attention(
    q_BHQE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor, block_mask
) -> torch.Tensor:
    """FlexAttention under the document block mask (compiled on CUDA, where it runs in training; CPU
    has its forward only, which the tests compare with the SDPA mask path)."""
    from torch.nn.attention.flex_attention import flex_attention

    if isinstance(block_mask, MetaBlockMask):
        return _FlexSizes.apply(q_BHQE, k_BKTE, v_BKTE, *block_mask.tensors, *block_mask.buffers)
    fn = _compiled_flex() if q_BHQE.is_cuda else flex_attention
    return fn(q_BHQE, k_BKTE, v_BKTE, block_mask=block_mask, enable_gqa=q_BHQE.shape[1] != k_BKTE.shape[1])


_FLEX = []


def _compiled_flex():
    if not _FLEX:  # one compiled kernel for every layer (torchtitan's pattern)
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX[0]


def rope_at(
    cos_SE: torch.Tensor, sin_SE: torch.Tensor, pos_BS: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE tables gathered at per-token positions, shaped [S, B, 1, E] for x_SBHE."""
    return cos_SE[pos_BS.t()].unsqueeze(2), sin_SE[pos_BS.t()].unsqueeze(2)
