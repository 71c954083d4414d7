"""Downstream evaluation: lm-evaluation-harness over megaframe checkpoints and live models."""
