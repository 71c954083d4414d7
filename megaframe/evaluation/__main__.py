"""lm-eval's own command line with the `megaframe` model registered:

    python -m megaframe.evaluation --model megaframe --model_args checkpoint=PATH --tasks hellaswag,arc_easy
    megaframe-lm-eval ...   (the same, as an installed script)

lm-eval 0.4 finds models only in its own registry (no plugin discovery), so a bare `lm_eval --model
megaframe` knows the name only in a process that imported megaframe.evaluation.lm_eval_adapter; this entry
point imports it and hands every argument to lm-eval's CLI unchanged.
"""

from __future__ import annotations


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    import megaframe.evaluation.lm_eval_adapter  # noqa: F401  registers "megaframe"

    cli_evaluate()


if __name__ == "__main__":
    main()
