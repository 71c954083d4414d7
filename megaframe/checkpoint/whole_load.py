"""`megaframe.load_model`'s body: a checkpoint's whole model on CPU in one process, whatever layout saved it.
Here, in the checkpoint package, so every tool below the package's public surface (the lm-eval adapter)
loads through it without importing upward; megaframe/__init__.py keeps the public name."""

from __future__ import annotations


def load_model(path: str):
    """The full model of a checkpoint on CPU in one process (any layout it was saved under).

    `path` is a step folder (step_XXXXXXXX) or a checkpoint dir holding `latest`.
    `model(input_ids_BS)` returns logits [batch, seq, vocab].
    """
    from omegaconf import OmegaConf

    from megaframe.checkpoint import resolve, sharded
    from megaframe.checkpoint.metadata import CheckpointError
    from megaframe.config.schema import Config
    from megaframe.model.parallelize import whole_model

    # a checkpoint dir: what `latest` names (a rollback's branch), checkpoint/resolve.py
    try:
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
