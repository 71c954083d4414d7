"""Export a megaframe checkpoint to a Hugging Face transformers folder.

    python scripts/export_hf.py CKPT OUT [--dtype fp32|bf16] [--max-position-embeddings N] [--force]

CKPT is a step folder (step_XXXXXXXX) or a checkpoint dir holding committed step folders (the one its
`latest` names: the live branch after a rollback); it may have been saved under any parallel layout. OUT
receives config.json, model.safetensors (LlamaForCausalLM for rmsnorm/swiglu/rope models, MixtralForCausalLM
for their softmax top-k MoE variant, GPT2LMHeadModel for layernorm/gelu/learned-position models) and, when the
run's tokenizer is found (the one the checkpoint records, checked by its sha256, or one of that sha256 beside
the run's datasets), a transformers tokenizer (a sentencepiece tokenizer.model is converted to tokenizer.json,
encoding exactly alike) that AutoTokenizer.from_pretrained(OUT) loads offline. All model.vocab_size
embedding rows are exported, even when the tokenizer has fewer. A RoPE model's max_position_embeddings is
the model's own context (model.max_position_embeddings, recorded by import_hf from the HF config), not the
model.seq_length a continued run trained at; --max-position-embeddings N writes N instead (a learned-position
model always writes its table's seq_length rows).
Bad input (missing or corrupt checkpoint, unsupported model, OUT not empty, only tokenizers of another sha256
than the recorded one) exits 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaframe.errors import fail, one_line, write_refused  # noqa: E402  (after the path insert)
from megaframe.quiet import quiet_optional_imports  # noqa: E402

quiet_optional_imports()  # transformers loads torchao, whose loader lines say nothing to act on


def read_checkpoint(step: Path, meta: dict):
    """(ModelConfig, {megaframe name: full tensor}, data config dict) of a verified step folder."""
    import dataclasses

    from omegaconf import OmegaConf

    from megaframe.checkpoint import sharded
    from megaframe.config import ModelConfig

    config = meta.get("config") or {}
    if "model" not in config:
        raise ValueError(f"{step}: metadata.json carries no model config")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    # merged onto the schema: nested groups (rope_scaling) become dataclasses, keys a checkpoint predates
    # keep their defaults
    model_cfg = OmegaConf.to_object(
        OmegaConf.merge(
            OmegaConf.structured(ModelConfig), {k: v for k, v in config["model"].items() if k in known}
        )
    )
    state = {
        k.removeprefix("model/"): sharded.load_full(step, k, meta)
        for k in meta["tensors"]
        if k.startswith("model/")
    }
    if not state:
        raise ValueError(f"{step}: no model tensors in the checkpoint")
    return model_cfg, state, config.get("data") or {}


def export_tokenizer(step: Path, meta: dict, out: Path, seq_length: int):
    """Write the run's tokenizer into `out` as a transformers tokenizer; returns it, or None if there is none.
    The run's tokenizer is the one its checkpoint records, checked against the recorded sha256, else a
    tokenizer with that sha256 among its datasets' (megaframe.inference.files.tokenizer_path): never the
    data= preset's data.path in a blend or stages run, never another vocabulary (ValueError: exit 2)."""
    from megaframe.checkpoint.hf import save_tokenizer
    from megaframe.inference.files import tokenizer_path

    path = tokenizer_path(step, meta)
    if path is None:
        print(
            f"export: no tokenizer found for {step} (none recorded or beside its data); exporting the "
            "model only",
            flush=True,
        )
        return None
    if path.is_dir():  # already a transformers tokenizer (prepared with data.tokenizer=FOLDER)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        tok.save_pretrained(str(out))
    else:
        tok = save_tokenizer(path, out, model_max_length=seq_length)
    write_provenance(path, out)
    print(f"export: tokenizer {path} -> {out} ({len(tok)} tokens)", flush=True)
    return tok


PROVENANCE = "megaframe_tokenizer.json"
"""Beside the exported tokenizer: the hash of the run's tokenizer it encodes exactly like, and of the
tokenizer.json written, so import_hf can let the imported model train on the run's prepared data as is
(an export -> import round trip needs no re-tokenisation) unless the tokenizer was changed since."""


def write_provenance(src: Path, out: Path) -> None:
    from megaframe.data.tokenizer import load_tokenizer, tokenizer_sha256

    if not (out / "tokenizer.json").is_file():  # a slow tokenizer saved as is: nothing to vouch for
        return
    record = {
        "converted_from": {"sha256": tokenizer_sha256(src), "kind": load_tokenizer(src).kind},
        "tokenizer_json_sha256": tokenizer_sha256(out / "tokenizer.json"),
    }
    (out / PROVENANCE).write_text(json.dumps(record, indent=1) + "\n")


def advertised(model_cfg, asked: int | None):
    """The model config to export: max_position_embeddings as asked (--max-position-embeddings), else the
    model's own (the imported HF config's, else seq_length). ValueError for a learned-position model, whose
    position table has exactly seq_length rows."""
    import dataclasses

    if asked is None:
        return model_cfg
    if str(model_cfg.position_embedding) != "rope":
        raise ValueError(
            f"--max-position-embeddings {asked}: a learned-position model exports its position table's "
            f"{model_cfg.seq_length} rows (model.seq_length); only a RoPE model's context can be set"
        )
    return dataclasses.replace(model_cfg, max_position_embeddings=asked)


def export(ckpt: str, out: Path, dtype: str, max_positions: int | None = None) -> Path:
    import torch

    from megaframe.checkpoint import resolve, sharded
    from megaframe.checkpoint.hf import build_hf_model, family, past_last_layer, to_hf

    def read(step: Path):
        meta = sharded.verify(step)
        try:
            return meta, read_checkpoint(step, meta)
        except (OSError, KeyError, RuntimeError) as e:  # unreadable shard contents
            raise ValueError(f"{step}: cannot read the checkpoint ({str(e).splitlines()[0]})") from e

    # a live run's checkpoint dir: a step pruned while it is read is read again at the new `latest`
    step, (meta, (model_cfg, state, data)) = resolve.read_newest(ckpt, read)
    family(model_cfg)  # refuse an unsupported model before writing anything
    model_cfg = advertised(model_cfg, max_positions)
    context = model_cfg.max_position_embeddings or model_cfg.seq_length
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tok = export_tokenizer(step, meta, tmp, context)
        ids = {"eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id} if tok is not None else {}
        cfg, sd = to_hf(model_cfg, state, **ids)
        model = build_hf_model(cfg, sd)
        if dtype == "bf16":
            model = model.to(torch.bfloat16)
        # the layers after the last (DeepSeek's MTP depths) travel in the files, as DeepSeek's carry them
        extra = {k: v.to(next(model.parameters()).dtype) for k, v in past_last_layer(sd, cfg).items()}
        model.save_pretrained(str(tmp), **({"state_dict": {**model.state_dict(), **extra}} if extra else {}))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    os.replace(tmp, out)
    n = sum(t.numel() for t in state.values())
    print(
        f"export: {step} (step {meta['step']}, {n / 1e6:.2f}M params) -> {out} as "
        f"{cfg.architectures[0]} ({dtype}), max_position_embeddings {context}",
        flush=True,
    )
    return out


def overlaps_input(ckpt: str, out: Path) -> str | None:
    """Why OUT may not be written: it is the checkpoint read (or its checkpoint dir), a folder holding
    it (--force would delete it) or a folder inside it (the export would change a committed checkpoint)."""
    from megaframe.checkpoint import resolve

    given = Path(ckpt)
    try:
        inputs = {given.resolve(), resolve.step_folder(given, warn=lambda m: None).resolve()}
    except ValueError:
        inputs = {given.resolve()}  # reported by the export itself
    o = out.resolve()
    for src in inputs:
        if o == src or o in src.parents or src in o.parents:
            return (
                f"OUT={out} overlaps the checkpoint it exports "
                f"({src}): writing there would replace or change "
                "it; pick another OUT"
            )
    return None


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", help="step folder or checkpoint dir")
    ap.add_argument("out", help="output transformers folder")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="weight dtype written")
    ap.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        metavar="N",
        help="context written to config.json (default: the model's own, e.g. the imported HF config's, "
        "else model.seq_length); RoPE models only",
    )
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists and is not empty")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.max_position_embeddings is not None and args.max_position_embeddings < 1:
        return fail(f"--max-position-embeddings {args.max_position_embeddings} must be a positive integer")
    clash = overlaps_input(args.ckpt, out)
    if clash:
        return fail(clash)
    from megaframe.runops.access.runlock import RunDirBusy, RunLock

    # one export into OUT at a time: a second one would delete the first's OUT.tmp mid-write
    lock = RunLock(out, "OUT", beside=True)
    try:
        lock.acquire()
    except RunDirBusy as e:
        return fail(e)
    try:
        if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
            return fail(f"{out} exists and is not empty (pass --force to replace it)")
        export(args.ckpt, out, args.dtype, args.max_position_embeddings)
    except ValueError as e:
        return fail(" ".join(str(e).split()))
    except Exception as e:  # a full disk or the file-size limit mid-write: OUT.tmp is gone, OUT untouched
        if not write_refused(e):
            raise
        return fail(f"OUT={out}: cannot write the export ({one_line(e)}); nothing was written", code=1)
    finally:
        lock.release()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
