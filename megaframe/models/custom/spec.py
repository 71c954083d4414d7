"""megaframe's configurable transformer: the shared block (model/block.py) with any combination of its
switches (norm, activation, positions, q/k norms, biases, experts and their routing). It trains, plans and
generates like any family; no transformers class computes it, so it does not export. Old configs and
checkpoints that name no family and fit no other one are of this family (models/registry.py: infer)."""

from megaframe.models.spec import FamilySpec


def check(m) -> list[str]:
    return []  # every config the shared block builds (config/checks.py holds the switches' own rules)


def to_hf(m, state, eos=None, bos=None):
    raise ValueError(
        f"model.family=custom ({m.name}) has no transformers counterpart: export needs a family with one "
        "(llama, qwen3, gpt2, mixtral: docs/after-training.md)"
    )


SPEC = FamilySpec(name="custom", presets=("custom_tiny",), check=check, to_hf=to_hf)
