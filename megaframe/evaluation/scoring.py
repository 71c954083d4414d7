"""Scoring token sequences under the model's own layout: log-likelihoods of continuations and greedy text.

Every rank of the job takes part. Each dp replica scores its contiguous share of the requests; a row's
logits exist on the last pipeline stage as this rank's vocab rows (tp), so the log-probabilities come
from the training loss's vocab-parallel cross-entropy and the greedy check from the max gathered over
tp. The last stage's figures reach the other stages by a sum over pp (they add 0), and the shares are
gathered over dp: every rank ends with every result, all through parallel/comm/.

Rows are padded to model.seq_length (sp splits the sequence evenly; causal attention never reads the
padding) and every dp rank runs the same number of forwards (empty rows fill the last batch): ZeRO-3
gathers parameters over dp inside the forward, so a replica with one batch fewer would hang the others.

Truncation and the context/continuation split follow lm-eval's `hf` model, so the numbers are the ones
an exported checkpoint gets there.
"""

from __future__ import annotations

import math

import torch

from megaframe.inference.sampler import forward_logits
from megaframe.layers.vocab import vocab_parallel_cross_entropy
from megaframe.parallel import comm

PAD = 0  # unk: never eos, so document masking sees no boundary in the padding


def check_layout(mesh) -> None:
    """Scoring runs tp, pp and dp; context parallelism splits the sequence it reads whole."""
    if mesh.cp.size > 1:
        raise ValueError(f"downstream evaluation needs parallel.cp=1 (got cp={mesh.cp.size})")


def _share(n: int, mesh, batch_size: int) -> tuple[range, int]:
    """This dp rank's contiguous slice of n items and the number of batches every rank runs."""
    per = math.ceil(n / mesh.dp.size) if n else 0
    start = min(n, mesh.dp.rank * per)
    return range(start, min(n, start + per)), max(1, math.ceil(per / batch_size)) if per else 0


def global_argmax(logits_BSV: torch.Tensor, tp) -> torch.Tensor:
    """Index of the largest logit over the whole vocabulary (the first on ties, as torch.argmax on the
    gathered row): each tp rank's max and its global index, gathered, the rank with the largest wins."""
    m_BS, i_BS = logits_BSV.float().max(dim=-1)
    if tp.size == 1:
        return i_BS
    both = torch.stack([m_BS.double(), (i_BS + tp.rank * logits_BSV.shape[-1]).double()])
    g = comm.all_gather_dim0(both.unsqueeze(0).contiguous(), tp)  # [tp, 2, B, S]
    best_BS = g[:, 0].argmax(dim=0)  # first rank holding the max: the lowest vocabulary index
    return g[:, 1].gather(0, best_BS.unsqueeze(0)).squeeze(0).long()


def _rows(pairs, seq: int):
    """(ids_BS, targets_BS, mask_BS) of (context, continuation) token lists, lm-eval's truncation: the
    last seq+1 tokens, the input all but the last, the continuation's tokens scored at the end."""
    b = len(pairs)
    ids = torch.full((b, seq), PAD, dtype=torch.long)
    tgt = torch.full((b, seq), PAD, dtype=torch.long)
    mask = torch.zeros((b, seq), dtype=torch.bool)
    for r, (ctx, cont) in enumerate(pairs):
        whole = (list(ctx) + list(cont))[-(seq + 1) :]
        n = len(whole) - 1
        ids[r, :n] = torch.tensor(whole[:-1])
        tgt[r, :n] = torch.tensor(whole[1:])
        mask[r, n - min(len(cont), n) : n] = True
    return ids, tgt, mask


@torch.no_grad()
def loglikelihoods(
    model, mesh, pairs: list[tuple[list[int], list[int]]], batch_size: int = 8, beat=None
) -> list[tuple[float, bool]]:
    """(sum of log p(continuation | context), whether greedy decoding gives the continuation) per pair;
    `beat()`, when given, after each batch (the hang watchdog hears the progress)."""
    check_layout(mesh)
    seq, dev = model.cfg.seq_length, mesh.device
    mine, rounds = _share(len(pairs), mesh, batch_size)
    per = math.ceil(len(pairs) / mesh.dp.size) if pairs else 0
    out = torch.zeros((per, 2), dtype=torch.float64, device=dev)
    for k in range(rounds):
        part = [pairs[i] for i in mine[k * batch_size : (k + 1) * batch_size]]
        ids, tgt, mask = (t.to(dev) for t in _rows(part + [([PAD], [PAD])] * (batch_size - len(part)), seq))
        logits_BSV = forward_logits(model, mesh, ids)
        if beat is not None:
            beat()
        if logits_BSV is None:
            continue
        nll_BS = vocab_parallel_cross_entropy(logits_BSV.transpose(0, 1), tgt.t(), mesh.tp).t()
        hit_BS = global_argmax(logits_BSV, mesh.tp) == tgt
        for r in range(len(part)):
            # an fp32 sum over the continuation, as lm-eval's hf model adds its log-probabilities
            out[k * batch_size + r, 0] = -nll_BS[r][mask[r]].float().sum().double()
            out[k * batch_size + r, 1] = float(bool(hit_BS[r][mask[r]].all()))
    out = comm.all_reduce(out, mesh.pp) if mesh.pp.size > 1 else out
    every = comm.all_gather_dim0(out, mesh.dp)
    return [(float(every[i, 0]), bool(every[i, 1] > 0.5)) for i in range(len(pairs))]


@torch.no_grad()
def greedy_texts(
    model, mesh, prompts: list[list[int]], max_new: int, stop, vocab: int, batch_size: int = 8, beat=None
) -> list[list[int]]:
    """Greedy continuations (token ids) of each prompt, at most max_new tokens and never past
    model.seq_length, among the tokenizer's `vocab` ids; `stop(ids)` says when a row is done (an `until`
    string, eos). The dp replicas step together (a max over dp says whether any row anywhere still runs),
    so ZeRO-3's gathers stay paired. `beat()`, when given, after each token (the hang watchdog hears it)."""
    check_layout(mesh)
    seq, dev = model.cfg.seq_length, mesh.device
    mine, rounds = _share(len(prompts), mesh, batch_size)
    per = math.ceil(len(prompts) / mesh.dp.size) if prompts else 0
    width = max(1, min(max_new, seq - 1))
    out = torch.full((per, width + 1), -1, dtype=torch.long, device=dev)  # col 0: the count
    for k in range(rounds):
        rows = [
            list(prompts[i])[-(seq - width) :] or [PAD] for i in mine[k * batch_size : (k + 1) * batch_size]
        ]
        new: list[list[int]] = [[] for _ in rows]
        done = [False] * len(rows)
        for _ in range(width):
            running = torch.tensor(float(not all(done)), device=dev)
            if mesh.dp.size > 1:  # one host read per token: the replicas must agree to stop together
                running = comm.all_reduce(running, mesh.dp, op=torch.distributed.ReduceOp.MAX)
            if not running:
                break
            toks = _next_tokens(model, mesh, [r + n for r, n in zip(rows, new)], batch_size, seq, vocab)
            if beat is not None:
                beat()
            for r in range(len(rows)):
                if not done[r] and len(rows[r]) + len(new[r]) < seq:
                    new[r].append(int(toks[r]))
                    done[r] = stop(new[r]) or len(rows[r]) + len(new[r]) >= seq
        for r, ids in enumerate(new):
            out[k * batch_size + r, 0] = len(ids)
            out[k * batch_size + r, 1 : 1 + len(ids)] = torch.tensor(ids, dtype=torch.long)
    every = comm.all_gather_dim0(out, mesh.dp)
    return [every[i, 1 : 1 + int(every[i, 0])].tolist() for i in range(len(prompts))]


def _next_tokens(model, mesh, rows: list[list[int]], batch_size: int, seq: int, vocab: int) -> torch.Tensor:
    """The greedy next token of each row (the same on every rank of the replica); the embedding's padded
    rows past the tokenizer's vocabulary are never chosen (no text decodes them)."""
    ids = torch.full((batch_size, seq), PAD, dtype=torch.long, device=mesh.device)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
    logits_BSV = forward_logits(model, mesh, ids)
    toks = torch.zeros(batch_size, dtype=torch.long, device=mesh.device)
    if logits_BSV is not None:
        v = logits_BSV.shape[-1]
        padded = torch.arange(v, device=mesh.device) + mesh.tp.rank * v >= vocab
        logits_BSV = logits_BSV.float().masked_fill(padded, float("-inf"))
        ends = [max(len(r), 1) - 1 for r in rows] + [0] * (batch_size - len(rows))
        last = torch.tensor(ends, device=mesh.device)
        toks = global_argmax(logits_BSV, mesh.tp).gather(1, last.unsqueeze(1)).squeeze(1)
    return comm.all_reduce(toks, mesh.pp) if mesh.pp.size > 1 else toks
