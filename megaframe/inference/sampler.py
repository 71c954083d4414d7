"""Greedy samples during training, under the run's own layout (train.sample_interval).

Every rank takes part: each dp replica runs the same forward (no cross-replica traffic). A token is
chosen on the last pipeline stage from the full logits (this rank's vocab rows gathered over tp) and
sent to the other stages by a sum over pp (the others add 0). No KV cache: each new token re-runs the
padded sequence (seq_length positions, so sp's split and learned positions hold; causal attention
keeps the padding out of the positions read). Samples are short and rare, so this costs little.

Legend: B batch (1), S seq_length, D hidden, V vocab rows on this rank.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from megaframe.config.schema import DataConfig, TrainConfig
from megaframe.parallel import comm
from megaframe.pipeline import p2p


def forward_logits(model, mesh, ids_BS: torch.Tensor) -> torch.Tensor | None:
    """logits_BSV of this rank's vocab rows on the last pipeline stage; None on the others."""
    if mesh.pp.size == 1:
        return model(ids_BS)
    pp, rank = mesh.pp.size, mesh.pp.rank
    last = pp * len(model.stage.chunks) - 1
    dtype = next(model.parameters()).dtype
    b, s = ids_BS.shape
    out = None
    for chunk in range(len(model.stage.chunks)):
        stage = chunk * pp + rank
        x_SBD = None
        if stage > 0:
            x_SBD = torch.empty(
                (s // mesh.tp.size if model.sp else s, b, model.cfg.hidden_size),
                dtype=dtype,
                device=mesh.device,
            )
            p2p.start(mesh.pp, [], [(x_SBD, (rank - 1) % pp)]).wait()
        y = model.forward_chunk(chunk, x_SBD, ids_BS, None)
        if stage == last:
            out = y
        else:
            p2p.start(mesh.pp, [(y.contiguous(), (rank + 1) % pp)], []).wait()
    return out


@torch.no_grad()
def greedy(model, mesh, prompt: list[int], new_tokens: int, vocab: int, beat=None) -> list[int]:
    """Greedy continuation of `prompt` under the model's layout (collective over tp and pp); `beat()`, when
    given, after each token (the hang watchdog hears the progress)."""
    seq = model.cfg.seq_length
    # the prompt's tail, so at least one new position fits; an empty prompt starts from token 0
    ids = list(prompt)[-(seq - 1) :] or [0]
    out = []
    for _ in range(min(new_tokens, seq - len(ids))):
        # padded to seq_length: sp splits the sequence evenly, and causal attention never reads the padding
        x_BS = torch.tensor([ids + [0] * (seq - len(ids))], dtype=torch.long, device=mesh.device)
        logits_BSV = forward_logits(model, mesh, x_BS)
        # 0 off the last stage: the sum over pp then hands every stage the last stage's token
        tok = torch.zeros((), dtype=torch.long, device=mesh.device)
        if logits_BSV is not None:
            # the whole vocab row gathered over tp: an argmax over this rank's slice would be a local one
            row_V = comm.all_gather_dim0(logits_BSV[0, len(ids) - 1].float().contiguous(), mesh.tp)
            tok = row_V[:vocab].argmax()  # padded rows are never chosen
        tok = comm.all_reduce(tok, mesh.pp)
        out.append(int(tok))  # host read: the next forward's input is this token
        ids.append(out[-1])
        if beat is not None:
            beat()
    return out


class Sampler:
    """Built once per run when train.sample_interval > 0; `sample(step, model, tracker)` at due steps."""

    def __init__(self, t: TrainConfig, mesh, tokenizer):
        self.t, self.mesh, self.tok = t, mesh, tokenizer
        self.prompts = [(p, tokenizer.encode([p])[0]) for p in t.sample_prompts]

    @classmethod
    def build(cls, t: TrainConfig, d: DataConfig, mesh) -> "Sampler | None":
        """None unless train.sample_interval > 0 and the data group `d` names a tokenizer."""
        from megaframe.data.tokenizer import load_tokenizer
        from megaframe.inference.files import tokenizer_record

        if t.sample_interval <= 0:
            return None
        rec = tokenizer_record(d)
        if rec is None:
            if mesh.is_logger:
                print(
                    "megaframe: warning: train.sample_interval: no tokenizer (synthetic data?); no samples",
                    file=sys.stderr,
                    flush=True,
                )
            return None
        return cls(t, mesh, load_tokenizer(rec["path"]))

    def _text(self, prompt: list[int], new: list[int]) -> str:
        """The continuation's text (decoded after the prompt: sentencepiece drops a text's leading space)."""
        return self.tok.decode(prompt + new)[len(self.tok.decode(prompt)) :]

    def due(self, step: int) -> bool:
        return step % self.t.sample_interval == 0

    def _append(self, path: Path, text: str) -> None:
        """samples.jsonl is not worth a run: a full disk is
        one warning (the first time), then the console only."""
        try:
            with open(path, "a") as f:
                f.write(text)
        except OSError as e:
            if not getattr(self, "_warned", False):
                print(
                    f"megaframe: warning: cannot write {path} ({e}); samples go to the console only",
                    file=sys.stderr,
                    flush=True,
                )
            self._warned = True

    def sample(self, step: int, model, run_dir: str, wandb_run=None, beat=None) -> float:
        """Write the samples of this step; returns the seconds spent. `beat()` after each token."""
        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        counted = self.mesh.stats.pop()  # keep sampling traffic out of the step's comm_bytes
        try:
            rows = [
                (
                    p,
                    self._text(
                        ids, greedy(model, self.mesh, ids, self.t.sample_tokens, self.tok.vocab_size, beat)
                    ),
                )
                for p, ids in self.prompts
            ]
        finally:
            model.train(was_training)
            self.mesh.stats.pop()
            for group, nbytes in counted.items():
                self.mesh.stats.add(group, nbytes)
        # one writer: every dp replica computed the same samples
        if self.mesh.is_logger:
            for p, text in rows:
                print(f"sample step {step}: {p!r} -> {text!r}", flush=True)
            self._append(
                Path(run_dir) / "samples.jsonl",
                "".join(json.dumps({"step": step, "prompt": p, "text": text}) + "\n" for p, text in rows),
            )
            if wandb_run is not None:
                import wandb

                wandb_run.log(
                    {
                        "samples": wandb.Table(
                            columns=["step", "prompt", "text"], data=[[step, p, t] for p, t in rows]
                        )
                    },
                    step=step,
                )
        return time.perf_counter() - t0
