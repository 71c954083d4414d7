"""The whole-config forms of the typed entry points, for tests: a test holds a whole loaded config where
the package's components take their own groups (docs/architecture.md, "The config")."""

from __future__ import annotations

from megaframe.training.startup import run_samples


def build_data(cfg, split: str = "train"):
    """The run's samples of `split` (data/kinds.py: build_samples on the config's groups)."""
    return run_samples(cfg, split)
