"""Document masking (`data.document_mask=true`): each token attends only within its own document, and
positions restart at every document, as if each document had been run alone (Llama 3 at 8k context;
torchtitan's block masks).

Legend: B batch, S sequence (the whole sample: cp is refused with document masking, and under sp the
attention sees the gathered sequence), E head dim.

A sample is a window of the concatenated token stream; a document ends at its end-of-document token, which
belongs to the document it ends. So doc_BS[t] = the number of end tokens before t, and the position of t
is t minus the first index of its document. The ids come from the micro-batch's input ids, on every
pipeline stage (the executor hands each stage its micro-batch), so every layout derives the same mask.

The loss is left as it is: the end token's label is the next document's first token, predicted from
the ended document alone (as torchtitan and Megatron do; nothing of the next document leaks into it).

The attention mask here is a boolean [B, 1, S, S] for SDPA (causal and same document); on CUDA that
selects the memory-efficient kernel instead of flash. A FlexAttention block mask would avoid the
[S, S] tensor; not done yet (see docs/data.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DocContext:
    """What attention and the position embeddings need of a micro-batch's documents."""
    pos_BS: torch.Tensor
    """Each token's position within its own document."""
    mask_B1SS: torch.Tensor
    """True where query s may attend key t: t <= s and the same document."""


def document_context(ids_BS: torch.Tensor, eos_ids: torch.Tensor) -> DocContext:
    """Document ids from the end tokens (any id in eos_ids ends a document), positions and the mask."""
    ends_BS = torch.isin(ids_BS, eos_ids).long()
    doc_BS = torch.cumsum(ends_BS, dim=1) - ends_BS  # an end token belongs to the document it ends
    s = ids_BS.shape[1]
    idx_S = torch.arange(s, device=ids_BS.device)
    # first index of each token's document: the running max of "an end token just before"
    starts_BS = torch.where(torch.nn.functional.pad(ends_BS[:, :-1], (1, 0)).bool(), idx_S, 0)
    first_BS = torch.cummax(starts_BS, dim=1).values
    same_BSS = doc_BS[:, :, None] == doc_BS[:, None, :]
    causal_SS = torch.ones(s, s, dtype=torch.bool, device=ids_BS.device).tril()
    return DocContext(idx_S - first_BS, (same_BSS & causal_SS).unsqueeze(1))


def rope_at(cos_SE: torch.Tensor, sin_SE: torch.Tensor, pos_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE tables gathered at per-token positions, shaped [S, B, 1, E] for x_SBHE."""
    return cos_SE[pos_BS.t()].unsqueeze(2), sin_SE[pos_BS.t()].unsqueeze(2)
