"""The generation loop: prefill the prompt, then one token at a time, with or without the KV cache.

Without the cache every new token re-runs the whole sequence through the training forward (quadratic
work; the baseline the cache is measured against). Generation stops at max_new tokens, at the eos
token, or at the model's seq_length (RoPE tables and learned positions end there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from megaframe.inference.kv import check_one_process, forward_cached, forward_full, new_cache
from megaframe.inference.sampling import SamplingConfig, next_token


@dataclass
class Generation:
    tokens: list[int]
    """The new tokens (eos included when it ended the text)."""
    prefill_s: float
    decode_s: float
    stopped: str
    """eos | max_new_tokens | seq_length."""

    @property
    def tokens_per_s(self) -> float:
        """Decode rate: new tokens after the first, over the time spent producing them."""
        return (len(self.tokens) - 1) / self.decode_s if len(self.tokens) > 1 and self.decode_s > 0 else 0.0


def generate(
    model,
    prompt: list[int],
    max_new: int,
    sampling: SamplingConfig,
    vocab: int,
    eos: int | None = None,
    use_cache: bool = True,
    on_token: Callable[[int], None] | None = None,
    index: int = 0,
) -> Generation:
    """Continue `prompt` (token ids) by up to max_new tokens; on_token(id) is called as each one is chosen.
    `index`: the prompt's place among a command's prompts, which picks its sampling stream."""
    check_one_process(model)
    device = next(model.parameters()).device
    limit = model.cfg.seq_length
    if not prompt or len(prompt) >= limit:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens; it must have 1 to {limit - 1} (model.seq_length)"
        )
    # a CPU generator: multinomial draws on the host, so a seed gives the same text on CPU and CUDA
    gen = sampling.generator(index)
    ids_BS = torch.tensor([prompt], dtype=torch.long, device=device)
    # preallocated to seq_length, the most positions there can be: no regrowth while decoding
    cache = new_cache(model, limit) if use_cache else None
    out: list[int] = []
    stopped = "max_new_tokens"
    t0 = time.perf_counter()
    logits_BSV = forward_cached(model, ids_BS, cache) if use_cache else forward_full(model, ids_BS)
    t_prefill = time.perf_counter()
    for n in range(max_new):
        # a host read: the loop needs the id
        tok = int(next_token(logits_BSV[:, -1], sampling, vocab, gen)[0])
        out.append(tok)
        if on_token is not None:
            on_token(tok)
        if eos is not None and tok == eos:
            stopped = "eos"
            break
        if len(prompt) + len(out) >= limit:
            stopped = "seq_length"
            break
        # the last token needs no forward: its logits would go unused
        if n + 1 == max_new:
            break
        new_BS = torch.tensor([[tok]], dtype=torch.long, device=device)
        if use_cache:
            logits_BSV = forward_cached(model, new_BS, cache)
        else:
            ids_BS = torch.cat([ids_BS, new_BS], dim=1)
            logits_BSV = forward_full(model, ids_BS)
    return Generation(out, t_prefill - t0, time.perf_counter() - t_prefill, stopped)
