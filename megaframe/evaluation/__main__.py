"""lm-eval's own command line with the `megaframe` model registered:

    python -m megaframe.evaluation --model megaframe --model_args checkpoint=PATH --tasks hellaswag,arc_easy
    megaframe-lm-eval ...   (the same, as an installed script)

lm-eval 0.4 finds models only in its own registry (no plugin discovery), so a bare `lm_eval --model
megaframe` knows the name only in a process that imported megaframe.evaluation.lm_eval_adapter; this entry
point imports it and hands every argument to lm-eval's CLI unchanged. Bad input is one line and exit code 2,
as in every megaframe tool: lm-eval's numeric options (--batch_size, --limit, --num_fewshot, --max_batch_size)
are range-checked by evaluation.lm_tasks.OPTION_RULES first, a missing --include_path folder is named, and
a megaframe model that cannot be built from its arguments (no checkpoint, no tokenizer, a tokenizer of
more ids than the model has) is named before lm-eval indexes its tasks, never as a traceback.
"""

from __future__ import annotations

import argparse
import sys

# lm-eval's spelling of the options megaframe checks, and their short forms
FLAGS = {
    "batch_size": ("--batch_size", "-b"),
    "limit": ("--limit", "-L"),
    "num_fewshot": ("--num_fewshot", "-f"),
    "max_batch_size": ("--max_batch_size",),
    "include_path": ("--include_path",),
}


def check_cli_options(argv: list[str]) -> None:
    """lm-eval's own numeric options and --include_path, before lm-eval runs (a negative --limit was an
    islice() error, --num_fewshot -1 was taken); ConfigError/ValueError names the flag and the value."""
    from megaframe.config.rules import POS, check_option
    from megaframe.evaluation.lm_eval_adapter import batch_option, check_args, one_batch_size
    from megaframe.evaluation.lm_tasks import check_task_options

    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for key, names in FLAGS.items():
        ap.add_argument(*names, dest=key)
    ap.add_argument("--model", dest="model")
    ap.add_argument("--model_args", "-a", dest="model_args", nargs="+", action="extend")
    given = {k: v for k, v in vars(ap.parse_known_args(argv)[0]).items() if v is not None}
    model, model_args = given.pop("model", None), given.pop("model_args", None)
    shown = lambda key, value: f"{FLAGS[key][0]} {value}"  # noqa: E731
    if "batch_size" in given:
        try:
            batch_option(given["batch_size"])
        except ValueError:
            raise ValueError(
                f"--batch_size {given['batch_size']} must be an integer >= 1, auto or auto:N"
            ) from None
    if "max_batch_size" in given:
        check_option(shown("max_batch_size", given["max_batch_size"]), given.pop("max_batch_size"), POS)
    check_task_options({k: v for k, v in given.items() if k != "batch_size"}, shown)
    if model == "megaframe":
        args = model_arguments(model_args or [])
        check_args(args)
        if "batch_size" in args and "batch_size" in given:
            one_batch_size(args["batch_size"], given["batch_size"])


def model_arguments(values: list[str]) -> dict:
    """`--model_args a=1,b=2 c=3` (or one JSON object) as lm-eval reads it, for the early check."""
    import json

    from lm_eval.utils import simple_parse_args_string

    text = ",".join(values)
    if text.strip().startswith("{"):
        try:
            return json.loads(text)
        except ValueError:
            return {}  # lm-eval itself names a malformed object
    return simple_parse_args_string(text)


def main(argv: list[str] | None = None) -> int:
    from megaframe.errors import fail

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        check_cli_options(argv)
    except ValueError as e:  # ConfigError is a ValueError
        return fail(e)
    from lm_eval.__main__ import cli_evaluate

    from megaframe.evaluation.lm_eval_adapter import ModelArgumentError  # registers "megaframe"

    saved = sys.argv
    sys.argv = [saved[0] if saved else "megaframe-lm-eval", *argv]  # lm-eval's CLI reads sys.argv
    try:
        cli_evaluate()
    except ModelArgumentError as e:
        return fail(e)
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
