"""lm-evaluation-harness model `megaframe`: a checkpoint (or the live training model) scored by lm-eval.

    lm_eval --model megaframe --model_args checkpoint=PATH[,tokenizer=PATH,batch_size=N] --tasks ...
    (after `import megaframe.evaluation.lm_eval_adapter`, or through python -m megaframe.evaluate)

PATH is a step folder or a checkpoint dir (its `latest`). The tokenizer is the run's (the one the checkpoint
records, else its prepared data's) unless `tokenizer=` names one. Tokenization, truncation and the
rolling windows are lm-eval's own (TemplateLM and the `hf` model's), so an exported folder scored by lm-eval's
`hf` model with the same tokenizer gives the same numbers. Under a training layout (`MegaframeLM.live`)
every rank gets every request and scoring/scoring.py splits them over dp.
"""

from __future__ import annotations

import contextlib

from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from megaframe.evaluation import scoring


@register_model("megaframe")
class MegaframeLM(TemplateLM):
    def __init__(
        self,
        checkpoint: str | None = None,
        tokenizer: str | None = None,
        batch_size: int | str = 8,
        model=None,
        mesh=None,
        tok=None,
        max_length: int | None = None,
        **_ignored,
    ):
        super().__init__()
        if model is None:
            model, mesh, tok = _load(checkpoint, tokenizer)
        self.model, self.mesh, self.tok = model, mesh, tok
        self.batch_size = 8 if batch_size in ("auto", None) else int(str(batch_size).split(":")[0])
        self._max_length = int(max_length or model.cfg.seq_length)
        self.beat = None
        """Called after each scored batch (the training loop's hang watchdog hears the progress)."""
        self.scoring = None
        """A context manager factory every scoring method runs in (its collectives run only there): the
        training loop agrees at its first entry over every rank that each has loaded the task, and may raise
        to skip it; inside, the hang watchdog hears each batch (evaluation/downstream.py)."""

    def _scoring(self):
        return self.scoring() if self.scoring is not None else contextlib.nullcontext()

    @classmethod
    def live(cls, model, mesh, tok, batch_size: int = 8) -> "MegaframeLM":
        """The training model under its own layout (every rank of the job calls every method)."""
        return cls(model=model, mesh=mesh, tok=tok, batch_size=batch_size)

    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return "megaframe"

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tok.encode([string])[0]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple]:
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        with self._scoring():
            out = scoring.loglikelihoods(self.model, self.mesh, pairs, self.batch_size, self.beat)
        for (key, _, _), answer in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The `hf` model's windows (disjoint, max_length tokens, one of context), scored in one pass."""
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for w in map(
                utils.make_disjoint_window,
                utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, *w))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += ll
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations cut at the first `until` string (lm-eval's default: the eos text)."""
        with self._scoring():
            return self._generate(requests)

    def _generate(self, requests) -> list[str]:
        out = [None] * len(requests)
        groups: dict = {}  # requests sharing gen_kwargs run together
        for i, req in enumerate(requests):
            ctx, kw = req.args
            groups.setdefault(repr(sorted((kw or {}).items())), (kw or {}, []))[1].append((i, ctx))
        for kw, items in groups.values():
            if kw.get("do_sample") or float(kw.get("temperature", 0.0) or 0.0) > 0:
                raise ValueError("megaframe's lm-eval model decodes greedily: no do_sample/temperature")
            until = kw.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            until.append(self.tok.decode([self.eot_token_id]))
            max_new = int(kw.get("max_gen_toks", 256))

            def stop(ids, until=until):
                return ids[-1] == self.eot_token_id or any(u and u in self.tok.decode(ids) for u in until)

            prompts = [self.tok_encode(ctx) for _, ctx in items]
            texts = scoring.greedy_texts(
                self.model, self.mesh, prompts, max_new, stop, self.tok.vocab_size, self.batch_size, self.beat
            )
            for (i, ctx), ids in zip(items, texts):
                text = self.tok.decode([t for t in ids if t != self.eot_token_id])
                for u in until:
                    if u:
                        text = text.split(u)[0]
                out[i] = text
                self.cache_hook.add_partial("generate_until", (ctx, kw), text)
        return out


def _load(checkpoint: str | None, tokenizer: str | None):
    """(model, one-process mesh, tokenizer) of a checkpoint; ValueError names what is wrong."""
    import megaframe
    from megaframe.inference.files import find_tokenizer, resolve_step
    from megaframe.parallel.mesh import single_process_mesh

    if not checkpoint:
        raise ValueError("the megaframe lm-eval model needs --model_args checkpoint=PATH")
    step, meta = resolve_step(checkpoint)
    tok, _ = find_tokenizer(step, meta, tokenizer)
    try:
        model = megaframe.load_model(str(step))
    except (OSError, KeyError, RuntimeError) as e:
        raise ValueError(f"{step}: cannot load the model ({str(e).splitlines()[0]})") from e
    return model, single_process_mesh("cpu"), tok
