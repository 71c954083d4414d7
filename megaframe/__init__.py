"""megaframe: Megatron-style LLM pretraining, every parallel layout proven equal to one process."""

from __future__ import annotations

__version__ = "0.1.0"


def load_model(path: str):
    """The full model of a checkpoint on CPU in one process (any layout it was saved under).

    `path` is a step folder (step_XXXXXXXX) or a checkpoint dir holding `latest`.
    `model(input_ids_BS)` returns logits [batch, seq, vocab].
    """
    from omegaconf import OmegaConf

    from megaframe.checkpoint import resolve, sharded
    from megaframe.checkpoint.metadata import CheckpointError
    from megaframe.config import Config
    from megaframe.model.parallelize import whole_model

    try:  # a checkpoint dir: what `latest` names (a rollback's branch), checkpoint/resolve.py
        step = resolve.step_folder(path)
    except CheckpointError as e:
        raise FileNotFoundError(str(e)) from None

    def read(step):
        meta = sharded.read_metadata(step)
        cfg: Config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), meta["config"]))
        model = whole_model(cfg.model)
        sharded.load_into(step, model)
        return model.eval()

    # a live run's checkpoint dir: the step pruned while it was read is read again at the new `latest`
    return resolve.read_newest(path, read, step=step)[1]
