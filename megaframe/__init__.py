"""megaframe: Megatron-style LLM pretraining, every parallel layout proven equal to one process."""

from __future__ import annotations

__version__ = "0.1.0"


def load_model(path: str):
    """The full model of a checkpoint on CPU in one process (any layout it was saved under).

    `path` is a step folder (step_XXXXXXXX) or a checkpoint dir holding `latest`.
    `model(input_ids_BS)` returns logits [batch, seq, vocab].
    """
    # imported here: `import megaframe` stays free of torch (megaframe/checkpoint/whole_load.py)
    from megaframe.checkpoint import whole_load

    return whole_load.load_model(path)
