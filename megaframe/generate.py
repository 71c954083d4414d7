"""Generate text from a checkpoint of any layout, in one process, with a KV cache.

    python -m megaframe.generate CKPT --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K]
                                 [--top-p P] [--seed S] [--prompts FILE] [--device cpu|cuda|auto]
                                 [--dtype fp32|bf16] [--no-cache] [--tokenizer PATH]

CKPT is a step folder or a checkpoint dir (its newest committed step). The tokenizer is the run's: the
one the checkpoint records, else its prepared data's, else an HF import's copy (or --tokenizer).
stdout carries the prompt and the generated text only, streamed as tokens are chosen (pipe it);
settings and timings go to stderr. --temperature 0 is greedy. --prompts FILE generates for each line.
Bad input (no checkpoint, no tokenizer, bad setting) exits 2 with one line.
"""

from __future__ import annotations

import argparse
import sys

from megaframe.config.rules import POS, check_option
from megaframe.errors import fail
from megaframe.inference.sampling import RULES as SAMPLING_RULES
from megaframe.inference.sampling import SamplingConfig

NUMBER_FLAGS = {"max_new_tokens": POS, **SAMPLING_RULES}
"""generate's numeric flags, by config/rules.py's rules (the sampling ones: inference.sampling.RULES)."""


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m megaframe.generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--prompt", action="append", default=[], help="may repeat")
    ap.add_argument("--prompts", help="a file with one prompt per line")
    # the numbers as typed: NUMBER_FLAGS' rules parse and judge them (argparse's own int() refused 1e3 with
    # a usage block, and took nan and inf)
    ap.add_argument("--max-new-tokens", default="64")
    ap.add_argument("--temperature", default="0.8")
    ap.add_argument("--top-k", default="0")
    ap.add_argument("--top-p", default="1.0")
    ap.add_argument("--seed", default="0")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    # fp32 by default: every checkpoint and every device runs it; bf16 halves the memory on a GPU
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every token")
    ap.add_argument("--tokenizer", help="a sentencepiece .model or transformers folder (default: the run's)")
    return ap.parse_args(argv)


def load(ckpt: str, device: str, dtype: str, tokenizer: str | None = None):
    """(model on device, tokenizer, its path, step folder): ValueError on bad input."""
    import torch

    import megaframe
    from megaframe.inference.files import check_vocab, find_tokenizer, read_step

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")

    def read(step, meta):
        found = find_tokenizer(step, meta, tokenizer)
        try:
            return found, megaframe.load_model(str(step))
        except (OSError, KeyError, RuntimeError) as e:
            raise ValueError(f"{step}: cannot load the model ({str(e).splitlines()[0]})") from e

    step, meta, ((tok, tok_path), model) = read_step(ckpt, read)
    model = model.to(device=device, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    if model.rope is not None:  # plain tensors, not buffers: .to() does not move them
        model.rope = tuple(t.to(device) for t in model.rope)
    check_vocab(tok, tok_path, model.cfg.vocab_size)
    return model, tok, tok_path, step


class Stream:
    """Writes the text of the tokens so far to stdout as it grows (decoding the whole tail each time, so a
    character split over byte-fallback pieces is written once complete)."""

    def __init__(self, tok, prompt_ids: list[int], out=None):
        # sys.stdout read when a stream starts, not when this module was imported (a default argument was
        # bound at import: a caller that swapped sys.stdout later, as a test's capture does, lost the text)
        out = out if out is not None else sys.stdout
        # decoding after the prompt's ids keeps the space sentencepiece drops at the start of a text
        self.tok, self.out, self.ids = tok, out, list(prompt_ids)
        self.written = tok.decode(self.ids)

    def __call__(self, token: int) -> None:
        if token == self.tok.eos_id:  # eos ends the text: nothing to print
            return
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its next byte
            return
        self.out.write(text[len(self.written) :])
        self.out.flush()
        self.written = text


def _prompts(args) -> list[str]:
    """--prompt and the lines of --prompts, each UTF-8 text; ValueError naming the flag otherwise."""
    prompts = list(args.prompt)
    if args.prompts:
        try:
            text = open(args.prompts, encoding="utf-8").read()
        except UnicodeDecodeError as e:
            raise ValueError(
                f"--prompts {args.prompts}: not UTF-8 text ({e.reason} at byte {e.start})"
            ) from None
        except OSError as e:  # the flag and the file, not a bare errno line
            raise ValueError(f"--prompts {args.prompts}: cannot be read ({e.strerror or e})") from None
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError("give --prompt TEXT or --prompts FILE")
    for prompt in prompts:  # argv bytes that are not UTF-8 arrive surrogate-escaped: no tokenizer takes them
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"--prompt {prompt!r} is not UTF-8 text") from None
    return prompts


def main(argv: list[str]) -> int:
    from megaframe.inference.decode import generate

    args = parse(argv)
    try:
        for name, rule in NUMBER_FLAGS.items():
            typed = getattr(args, name)
            setattr(args, name, check_option(f"--{name.replace('_', '-')} {typed}", typed, rule))
        s = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
        prompts = _prompts(args)
        model, tok, tok_path, step = load(args.ckpt, args.device, args.dtype, args.tokenizer)
    except (ValueError, OSError) as e:
        return fail(e)
    device = next(model.parameters()).device
    print(
        f"generate: {step} | {model.cfg.name} on {device.type} {args.dtype} | tokenizer {tok_path} | "
        f"temperature {s.temperature} top-k {s.top_k} top-p {s.top_p} seed {s.seed} | "
        f"kv cache {'off' if args.no_cache else 'on'}",
        file=sys.stderr,
        flush=True,
    )
    encoded = [tok.encode([prompt])[0] for prompt in prompts]
    limit = model.cfg.seq_length
    # all before any output (K10: a long 3rd prompt came after two outputs)
    for n, ids in enumerate(encoded, 1):
        if not ids or len(ids) >= limit:
            return fail(
                f"prompt {n} of {len(prompts)} has {len(ids)} tokens; each must have 1 to {limit - 1} "
                "(model.seq_length)"
            )
    for index, (prompt, ids) in enumerate(zip(prompts, encoded)):
        sys.stdout.write(prompt)
        sys.stdout.flush()
        try:
            g = generate(
                model,
                ids,
                args.max_new_tokens,
                s,
                tok.vocab_size,
                tok.eos_id,
                not args.no_cache,
                Stream(tok, ids),
                index,  # each prompt its own stream of (seed, index): not one stream restarted per prompt
            )
        except ValueError as e:
            return fail(e, prefix="\n")  # after the partial continuation on stdout
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(
            f"generate: {len(ids)} prompt tokens, {len(g.tokens)} new ({g.stopped}) | prefill "
            f"{g.prefill_s * 1e3:.1f} ms"
            f" | decode {g.tokens_per_s:.1f} tokens/s",
            file=sys.stderr,
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
