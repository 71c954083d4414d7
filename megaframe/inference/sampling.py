"""Next-token choice: greedy (temperature 0) or sampling with temperature, top-k and top-p (nucleus).

Sampling draws from a torch.Generator seeded once per generation from (seed, prompt index) (prompt_seed),
so a seed gives the same text on a machine every time, and the prompts of one command each draw their own
stream (one stream restarted per prompt gave every prompt nearly the same continuation). Logit rows beyond
the tokenizer's vocabulary (the embedding is padded to a multiple of the layout's needs) are never chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megaframe.config.rules import NONNEG, NONNEGF, SEED, SHARE, check_option


@dataclass
class SamplingConfig:
    temperature: float = 0.8
    """0 = greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 = all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches p; 1 = all."""
    seed: int = 0
    """Seeds the sampling generator."""

    def generator(self, index: int = 0) -> torch.Generator:
        """The CPU generator of the `index`-th prompt (0-based) of a command: seeded by prompt_seed."""
        return torch.Generator().manual_seed(prompt_seed(self.seed, index))

    def check(self) -> None:
        """Each setting by its RULES entry (config/rules.py's rules); ValueError names the flag at fault only
        (naming all three blamed the good ones too) with the value typed. nan and inf are refused: a nan
        temperature reached torch.multinomial as nan probabilities, an infinite one sampled uniformly."""
        for name, rule in RULES.items():
            value = getattr(self, name)
            check_option(f"--{name.replace('_', '-')} {value}", value, rule)


RULES = {
    "temperature": NONNEGF,  # 0: greedy
    "top_k": NONNEG,  # 0: off
    "top_p": SHARE,
    "seed": SEED,  # torch.Generator takes a non-negative int64
}


def prompt_seed(seed: int, index: int) -> int:
    """The generator seed of prompt `index` under --seed `seed`: the seed itself for the first prompt (one
    prompt samples what it always did), else a SeedSequence mix of (seed, index), deterministic and far
    apart for neighbouring seeds and prompts."""
    import numpy as np

    if index == 0:
        return seed
    # SeedSequence takes non-negative entries only: a negative --seed is mapped, not refused
    entropy = [seed % 2**64, index]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> 1)


def next_token(
    logits_BV: torch.Tensor, s: SamplingConfig, vocab: int, gen: torch.Generator | None
) -> torch.Tensor:
    """[B] token ids from the last position's logits."""
    # fp32: softmax and cumulative sums over a large vocabulary lose precision in bf16
    logits_BV = logits_BV.float()[:, :vocab]
    if s.temperature == 0:
        return logits_BV.argmax(-1)
    logits_BV = logits_BV / s.temperature
    if s.top_k:
        kth_B1 = torch.topk(logits_BV, min(s.top_k, vocab), dim=-1).values[:, -1:]
        # ties with the k-th logit stay: possibly more than k tokens, never fewer
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if s.top_p < 1:
        sorted_BV, order_BV = torch.sort(logits_BV, descending=True, dim=-1)
        cum_BV = sorted_BV.softmax(-1).cumsum(-1)
        drop_BV = cum_BV - sorted_BV.softmax(-1) >= s.top_p  # mass before this token already reaches p
        logits_BV = logits_BV.scatter(-1, order_BV, sorted_BV.masked_fill(drop_BV, float("-inf")))
    probs_BV = logits_BV.softmax(-1)
    # drawn on the host with the CPU generator: the same seed picks the same token on any device
    return torch.multinomial(probs_BV.cpu(), 1, generator=gen).squeeze(-1).to(logits_BV.device)
