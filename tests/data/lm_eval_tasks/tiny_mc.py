"""The tiny_mc task's documents: tiny_mc.jsonl beside this file (a path lm-eval's json loader would
otherwise resolve against the working directory)."""

from pathlib import Path


def load(**_kwargs):
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(Path(__file__).with_name("tiny_mc.jsonl"))})


def broken(**_kwargs):
    raise RuntimeError("tiny_broken: this task's documents are deliberately unreadable")
