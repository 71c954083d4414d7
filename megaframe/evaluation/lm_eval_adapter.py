"""lm-evaluation-harness model `megaframe`: a checkpoint (or the live training model) scored by lm-eval.

    python -m megaframe.evaluation --model megaframe --model_args checkpoint=PATH[,tokenizer=PATH]
                                   --tasks ... [--batch_size N]
    lm_eval.simple_evaluate(model="megaframe", model_args="checkpoint=PATH", batch_size=N, ...)
    (after `import megaframe.evaluation.lm_eval_adapter`, or through python -m megaframe.evaluate)

PATH is a step folder or a checkpoint dir (its `latest`). The tokenizer is the run's (the one the checkpoint
records, else its prepared data's) unless `tokenizer=` names one. The batch size is lm-eval's own
`--batch_size` (an integer >= 1; `auto` and `auto:N` take 8: there is no memory search here); a
`batch_size=` in `--model_args` is taken too when it agrees with it. Tokenization, truncation and the
rolling windows are lm-eval's own (TemplateLM and the `hf` model's), so an exported folder scored by lm-eval's
`hf` model with the same tokenizer gives the same numbers. Under a training layout (`MegaframeLM.live`)
every rank gets every request and scoring/scoring.py splits them over dp.
"""

from __future__ import annotations

import contextlib

# lm-eval fills its registry with its own models (hf, vllm, ...) only while the registry is empty: a
# registry holding just `megaframe` made `--model hf` "no model for this name found" in this process.
# Importing its models module first registers them (lazily, no backend imported).
import lm_eval.models  # noqa: F401
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from megaframe.config.rules import POS, as_number, check_option
from megaframe.errors import ConfigError
from megaframe.evaluation import scoring
from megaframe.evaluation.lm_tasks import OPTION_RULES

DEFAULT_BATCH = 8
TOKENIZER_OPTION = "--model_args checkpoint=PATH,tokenizer=PATH"


class ModelArgumentError(ValueError):
    """The model cannot be built from its arguments (a missing checkpoint or tokenizer, a bad batch size):
    bad input, which megaframe's lm-eval entry point prints as one line with exit code 2."""


def batch_option(batch_size) -> int:
    """lm-eval's batch size: an integer >= 1 (OPTION_RULES), or its `auto` / `auto:N` (N re-tunings of the
    memory search `hf` runs on a GPU), which take DEFAULT_BATCH here."""
    text = "auto" if batch_size is None else str(batch_size).strip()
    head, colon, tail = text.partition(":")
    if head == "auto" and (not colon or POS.why(as_number(tail)) is None):
        return DEFAULT_BATCH
    try:
        return check_option(f"batch_size={text}", batch_size, OPTION_RULES["batch_size"])
    except ConfigError:
        raise ConfigError(f"batch_size={text} must be an integer >= 1, auto or auto:N") from None


def one_batch_size(model_arg, cli) -> None:
    """A batch_size in --model_args beside lm-eval's --batch_size (always passed, default 1): the same
    value, or the CLI's default, is one batch size (it was a TypeError "multiple values" before); two
    different ones are refused rather than one silently winning."""
    if str(cli) not in (str(model_arg), "1"):
        raise ModelArgumentError(
            f"--model_args batch_size={model_arg} and --batch_size {cli} differ: give one of them"
        )


@register_model("megaframe")
class MegaframeLM(TemplateLM):
    def __init__(
        self,
        checkpoint: str | None = None,
        tokenizer: str | None = None,
        batch_size: int | str = DEFAULT_BATCH,
        model=None,
        mesh=None,
        tok=None,
        max_length: int | None = None,
        **_ignored,
    ):
        super().__init__()
        # the numbers first: a bad batch size is named before a checkpoint is read
        self.batch_size = batch_option(batch_size)
        max_length = check_option(f"max_length={max_length}", max_length, OPTION_RULES["max_length"])
        if model is None:
            model, mesh, tok = load_checkpoint(checkpoint, tokenizer)
        self.model, self.mesh, self.tok = model, mesh, tok
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
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "MegaframeLM":
        return cls.from_args(utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "MegaframeLM":
        return cls.from_args(dict(arg_dict), additional_config)

    @classmethod
    def from_args(cls, args: dict, additional_config: dict | None) -> "MegaframeLM":
        """lm-eval's CLI path: `--model_args` and its own settings (batch_size, always given: default 1;
        device, max_batch_size). A batch_size in both is one value when they agree or the CLI's is its
        default (else a TypeError "multiple values" before); any bad argument is ModelArgumentError."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        if "batch_size" in args and "batch_size" in extra:
            one_batch_size(args["batch_size"], extra.pop("batch_size"))
        try:
            return cls(**args, **extra)
        except ValueError as e:
            raise ModelArgumentError(str(e)) from e

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


def check_args(args: dict) -> None:
    """The model's arguments checked as far as they can be without loading the weights (the numbers, the
    checkpoint, its tokenizer and its vocabulary against the model's, from metadata.json): megaframe's
    lm-eval entry point asks this before lm-eval indexes its task folders (~12 s), so bad input is named
    within seconds. ModelArgumentError names what is wrong."""
    from megaframe.inference.files import check_vocab, find_tokenizer, resolve_step

    try:
        batch_option(args.get("batch_size"))
        check_option(
            f"max_length={args.get('max_length')}", args.get("max_length"), OPTION_RULES["max_length"]
        )
        if not args.get("checkpoint"):
            raise ValueError("the megaframe lm-eval model needs --model_args checkpoint=PATH")
        step, meta = resolve_step(args["checkpoint"])
        tok, tok_path = find_tokenizer(step, meta, args.get("tokenizer"), TOKENIZER_OPTION)
        vocab = ((meta.get("config") or {}).get("model") or {}).get("vocab_size")
        if isinstance(vocab, int):
            check_vocab(tok, tok_path, vocab)
    except ValueError as e:
        raise ModelArgumentError(str(e)) from e


def load_checkpoint(checkpoint: str | None, tokenizer: str | None, option: str = TOKENIZER_OPTION):
    """(model, one-process mesh, tokenizer) of a checkpoint; ValueError names what is wrong, a missing
    tokenizer with `option`, how the calling tool takes one."""
    from megaframe.checkpoint import whole_load
    from megaframe.inference.files import check_vocab, find_tokenizer, read_step
    from megaframe.parallel.mesh import single_process_mesh

    if not checkpoint:
        raise ValueError("the megaframe lm-eval model needs --model_args checkpoint=PATH")

    def read(step, meta):  # re-read at the new `latest` if a live run prunes the step meanwhile
        tok, tok_path = find_tokenizer(step, meta, tokenizer, option)
        try:
            model = whole_load.load_model(str(step))
        except (OSError, KeyError, RuntimeError) as e:
            raise ValueError(f"{step}: cannot load the model ({str(e).splitlines()[0]})") from e
        check_vocab(tok, tok_path, model.cfg.vocab_size)
        return tok, model

    _, _, (tok, model) = read_step(checkpoint, read)
    return model, single_process_mesh("cpu"), tok
