"""Import a Hugging Face transformers Llama, Qwen3, GPT-2
or Mixtral folder as a megaframe checkpoint at step 0.

    python scripts/import_hf.py HF_FOLDER OUT_CKPT_DIR [hydra overrides ...] [--force]

HF_FOLDER is a local folder (config.json + weights) of a model family megaframe/models/registry.py
registers (LlamaForCausalLM, Qwen3ForCausalLM, GPT2LMHeadModel, MixtralForCausalLM); it is loaded
offline. The model fields come from its config.json (RoPE scaling too: llama3, linear, yarn); the
overrides set the rest of the run config recorded in the checkpoint (data=..., optim.lr=..., train.*). The
result is a committed
checkpoint OUT_CKPT_DIR/step_00000000 with `latest`, holding the weights only (no optimizer moments:
training from it starts with fresh AdamW state at step 1). `megaframe.load_model(OUT_CKPT_DIR)` loads
it, and the printed `python train.py checkpoint.resume=...` command continues pretraining it under any
parallel layout (the model sizes come from the checkpoint). Bad input exits 2 with one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaframe.errors import fail, one_line, write_refused  # noqa: E402  (after the path insert)
from megaframe.quiet import quiet_optional_imports  # noqa: E402

quiet_optional_imports()  # transformers loads torchao, whose loader lines say nothing to act on


class WeightsOnly:
    """The optimizer interface sharded.save needs, with no state: the checkpoint holds weights only."""

    def logical_state(self, p) -> dict:
        return {}


def run_config(fields: dict, overrides: list[str]):
    """The full run Config: `overrides` composed as train.py would, with the HF model fields on top.

    The fields that shape the weights always come from HF; model.name, model.dropout and (for RoPE
    models, where it shapes no weight) model.seq_length keep the user's value when an override gives one."""
    from megaframe.config import ConfigError, load_config, validate

    cfg = load_config(list(overrides), world_size=1, check_data=False)
    soft = {"name", "dropout"} | ({"seq_length"} if fields.get("position_embedding") == "rope" else set())
    given = {o.split("=", 1)[0].removeprefix("++").removeprefix("+") for o in overrides if "=" in o}
    chosen = {}
    for k, v in fields.items():
        if f"model.{k}" in given and k in soft:
            continue
        if f"model.{k}" in given and getattr(cfg.model, k) != v:
            print(
                f"import: warning: model.{k}={getattr(cfg.model, k)} replaced by the HF config's {v}",
                file=sys.stderr,
            )
        chosen[k] = v
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, **chosen)
    )  # loaded configs are frozen
    try:
        validate(cfg, 1, check_data=False)
    except ConfigError as e:
        raise ValueError(f"the imported model does not fit the config: {e}") from e
    return cfg


def build_filled_model(cfg, state: dict):
    """A one-process GPT holding the imported full tensors (names and shapes must match exactly)."""
    import torch

    from megaframe.model.parallelize import whole_model

    model = whole_model(cfg.model)
    mesh = model.mesh
    names = dict(model.named_parameters())
    if set(names) != set(state):
        raise ValueError(
            f"HF weights do not map onto the megaframe model: missing {sorted(set(names) - set(state))[:4]}"
            f", extra {sorted(set(state) - set(names))[:4]}"
        )
    with torch.no_grad():
        for name, p in names.items():
            if tuple(p.shape) != tuple(state[name].shape):
                raise ValueError(f"{name}: HF shape {tuple(state[name].shape)} != megaframe {tuple(p.shape)}")
            p.copy_(state[name])
    return model, mesh


def copy_tokenizer(src: Path, dest: Path) -> dict | None:
    """Save the HF folder's tokenizer to `dest`, for `megaframe.data.prepare data.tokenizer=dest`: data
    for continued pretraining must be tokenized with the model's own tokenizer. Returns the identity the
    checkpoint records (content hash as prepare computes it, size), or None when there is none."""
    from transformers import AutoTokenizer

    from megaframe.data.tokenizer import load_tokenizer, tokenizer_sha256

    if not any(
        (src / n).is_file()
        for n in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    ):
        print(f"import: {src} has no tokenizer files; none copied", flush=True)
        return None
    try:
        tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    except (
        OSError,
        ValueError,
        KeyError,
    ) as e:  # no tokenizer files, or a kind transformers cannot load offline
        print(
            f"import: no tokenizer copied ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:120] if str(e) else ''})"
        )
        return None
    shutil.rmtree(dest, ignore_errors=True)
    tok.save_pretrained(str(dest))
    loaded = load_tokenizer(dest)  # the vocabulary as prepare will record it in meta.json
    identity = {
        "sha256": tokenizer_sha256(dest),
        "vocab_size": loaded.vocab_size,
        "kind": loaded.kind,
        "from": str(dest.resolve()),
    }
    origin = converted_from(src)
    if origin:  # a megaframe export: data prepared with the run's own tokenizer gives the same ids
        identity["same_as"] = [origin["sha256"]]
    print(
        f"import: tokenizer ({len(tok)} tokens) -> {dest}"
        + (
            f", an exact conversion of a {origin['kind']} tokenizer (data prepared with it is used as is)"
            if origin
            else ""
        ),
        flush=True,
    )
    return identity


def converted_from(src: Path) -> dict | None:
    """The tokenizer an HF folder's tokenizer was exported from (export_hf's provenance record), when its
    tokenizer.json is still the one exported; else None."""
    import json

    from megaframe.data.tokenizer import tokenizer_sha256

    try:
        record = json.loads((src / "megaframe_tokenizer.json").read_text())
        if tokenizer_sha256(src / "tokenizer.json") == record["tokenizer_json_sha256"]:
            return record["converted_from"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def continue_lines(path: Path, cfg, tok: dict | None, overrides: list[str]) -> list[str]:
    """The commands that continue pretraining the import: train.py on the data the overrides name when it
    was prepared with the model's tokenizer; else prepare first (before: the printed train command named
    data the check then refused)."""
    from megaframe.data.kinds import data_folders, tokenizer_identity
    from megaframe.data.shards import same_tokenizer

    rest = [
        o for o in overrides if not o.startswith("model.")
    ]  # the model comes from the checkpoint (config/adopt.py)
    data = tokenizer_identity(cfg.data)
    if tok is None or not data_folders(cfg.data) or (data is not None and same_tokenizer(tok, data)):
        return [
            "continue pretraining with:",
            f"  python train.py checkpoint.resume={path} {' '.join(rest)}".rstrip(),
        ]
    keys = ("data=", "data.path=", "data.blend=", "+data.blend=")
    rest = [o for o in rest if not o.startswith(keys)]
    why = "was prepared with another tokenizer" if data is not None else "is not prepared"
    return [
        f"the data ({cfg.data.path or 'data.blend'}) {why}: "
        "prepare your corpus with the model's tokenizer, then "
        "continue pretraining:",
        f"  python -m megaframe.data.prepare data.tokenizer={tok['from']} data.source=CORPUS data.path=DATA",
        f"  python train.py checkpoint.resume={path} data.path=DATA {' '.join(rest)}".rstrip(),
    ]


def import_hf(folder: str, out: Path, overrides: list[str]) -> Path:
    from megaframe.checkpoint import sharded
    from megaframe.checkpoint.hf import from_hf
    from megaframe.config.schema import plain
    from megaframe.data.order import ORDER

    src = Path(folder)
    if not (src / "config.json").is_file():
        raise ValueError(f"{folder}: not a transformers model folder (no config.json)")
    from safetensors import SafetensorError

    try:
        fields, state = from_hf(src)
    # SafetensorError: a truncated or corrupt model.safetensors (not an OSError)
    except (OSError, KeyError, RuntimeError, SafetensorError) as e:
        raise ValueError(f"{folder}: cannot load the transformers model ({str(e).splitlines()[0]})") from e
    except ValueError as e:  # a missing or non-finite weight, an unsupported architecture
        raise ValueError(f"{folder}: {e}") from e
    cfg = run_config(fields, overrides)
    model, mesh = build_filled_model(cfg, state)
    tok = copy_tokenizer(src, out / "hf_tokenizer")
    meta = {
        "consumed_samples": 0,
        "layout": {"tp": 1, "pp": 1, "dp": 1, "sp": False},
        "rng": "derived from (train.seed, step, rank); no state to restore",
        "data": {"kind": cfg.data.kind, "path": cfg.data.path, "consumed_samples": 0, "order": ORDER},
        "tokenizer": tok,  # train.py refuses data prepared with another tokenizer
        "config": plain(cfg),
        "imported_from": str(src.resolve()),
    }
    path = sharded.save(out, 0, model, WeightsOnly(), mesh, meta)
    n = sum(t.numel() for t in state.values())
    print(f"import: {folder} ({n / 1e6:.2f}M params, {fields['name']}) -> {path}", flush=True)
    print("\n".join(continue_lines(path, cfg, tok, overrides)), flush=True)
    return path


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_folder", help="local transformers model folder")
    ap.add_argument("out", help="checkpoint dir to write step_00000000 into")
    ap.add_argument("overrides", nargs="*", help="hydra overrides for the rest of the run config")
    ap.add_argument("--force", action="store_true", help="write even if OUT already holds checkpoints")
    args = ap.parse_args(argv)
    from megaframe.checkpoint import sharded
    from megaframe.config import ConfigError
    from megaframe.runops.access.runlock import RunDirBusy, RunLock

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return fail(f"{out} exists and is not a folder")
    # the trainer's lock of a checkpoint.dir: never write into one a live run (or another import) writes
    lock, created = RunLock(out, "checkpoint.dir"), not out.exists()
    try:
        lock.acquire()
    except RunDirBusy as e:
        return fail(e)
    try:
        if sharded.committed(out) and not args.force:
            return fail(
                f"{out} already holds checkpoints (pass --force to add step_00000000 and repoint latest)"
            )
        import_hf(args.hf_folder, out, args.overrides)
    except (ValueError, ConfigError) as e:
        return fail(" ".join(str(e).split()))
    except sharded.SaveError as e:  # a full disk at the save: its own one line, nothing committed
        return fail(e, code=1)
    except Exception as e:  # a full disk before the save (the tokenizer copy)
        if not write_refused(e):
            raise
        return fail(f"{out}: cannot write the import ({one_line(e)}); nothing was committed", code=1)
    finally:
        lock.release()
        if created and out.is_dir() and not any(out.iterdir()):  # a refused import leaves no empty folder
            out.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
