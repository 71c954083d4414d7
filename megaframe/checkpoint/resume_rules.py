"""What a config's checkpoint.resume must name, checked at load (config/checks.py runs them): a committed
checkpoint whose metadata is whole, a checkpoint dir whose live branch can be told, and a checkpoint
trained with the tokenizer the data was prepared with."""

from __future__ import annotations

from pathlib import Path

from megaframe.config.numeric_rule import _req
from megaframe.config.schema import CheckpointConfig, DataConfig
from megaframe.errors import ConfigError


def check_resume_setting(ck: CheckpointConfig) -> None:
    """checkpoint.resume names a committed checkpoint whose metadata is whole."""
    r = ck.resume
    if r == "auto":  # a checkpoint dir whose live branch cannot be told is refused before any rank starts
        from megaframe.checkpoint.resolve import Unresolved, head

        try:
            head(ck.dir, warn=lambda msg: None)  # resume warns once, on rank 0
        except Unresolved as e:
            raise ConfigError(f"checkpoint.resume=auto: {e}") from None
    _req(
        r in ("auto", "none") or (Path(r) / "metadata.json").is_file(),
        f"checkpoint.resume={r}: not a committed checkpoint folder (no metadata.json)",
    )
    if r not in ("auto", "none"):  # metadata only: shard bytes are checked where each rank reads them
        from megaframe.checkpoint.metadata import check_complete

        try:
            check_complete(r)
        except ValueError as e:
            raise ConfigError(f"checkpoint.resume={r}: {e}") from e


def check_checkpoint_tokenizer(ck: CheckpointConfig, d: DataConfig) -> None:
    """The checkpoint a run continues (checkpoint.resume, or the newest in checkpoint.dir) was trained
    with the tokenizer the data was prepared with: token ids of another tokenizer train silently on
    garbage (an imported 8,192-token model fed the demo's 4,096-piece data)."""
    from megaframe.checkpoint.resolve import head
    from megaframe.checkpoint.sharded import read_metadata
    from megaframe.data.kinds import data_folders, tokenizer_identity
    from megaframe.data.shards import same_tokenizer

    r = ck.resume
    if r == "none":
        return
    try:  # resume=auto's pick (the `latest` branch), or the named folder
        pick = head(ck.dir, warn=lambda msg: None) if r == "auto" else Path(r)
    except ValueError:
        return  # reported by check_resume_setting
    if pick is None:
        return
    found = [pick]
    try:
        meta = read_metadata(found[-1])
    except (OSError, ValueError):
        return  # the resume itself reports an unreadable checkpoint
    data = tokenizer_identity(d)
    tok = meta.get("tokenizer")
    if data is None or (tok is None and "imported_from" not in meta):
        return  # a checkpoint written before tokenizers were recorded: nothing to compare
    if tok is None:  # an import without tokenizer files: its vocabulary is all there is to compare
        tok = {"vocab_size": meta["config"]["model"]["vocab_size"], "kind": "unknown", "sha256": None}
    # the hash when both sides recorded one (or the one an imported tokenizer was converted from); else the
    # vocabulary size, the one figure an import always has
    if same_tokenizer(tok, data):
        return
    key, path = data_folders(d)[0]
    fix = f"; prepare the data with data.tokenizer={tok['from']}" if tok.get("from") else ""
    raise ConfigError(
        f"checkpoint {found[-1]} was trained with a {tok['kind']} tokenizer of {tok['vocab_size']} "
        f"tokens, but {key}={path} was prepared with a {data['kind']} tokenizer of "
        f"{data['vocab_size']} tokens{fix}"
    )
