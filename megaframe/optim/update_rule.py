"""The update-rule seam: what an optimizer's math is, apart from how it is distributed.

An `UpdateRule` is a record: its name (`optim.name`), the names of the state it keeps per parameter element,
their bytes per element in each state dtype, whether it is elementwise, and how it builds its step over
parameter groups. The distribution strategies (optim/build.py's zero=0, ZeRO-1/2 and HSDP in zero.py,
ZeRO-3 in zero3.py) hold "some state per owned element" under the rule's names and never name it
themselves; checkpoints, the save guard and the planner read the names and bytes from the rule.
optim/rule_registry.py registers the rules by name.

An elementwise rule (AdamW) can run on any flat range of a parameter, so ZeRO's owned ranges, which cut across
parameters, never change its math. A rule that needs whole matrices cannot run on them.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""optim.state_dtype -> the torch dtype of a rule's per-element state."""

Groups = dict[str, list[torch.Tensor]]
"""The tensors a step updates, by kind: "matrix" (a parameter of >= 2 dims, or a flat range of one) and
"vector" (norms, biases). A strategy passes 1-D views of owned ranges under ZeRO, whole params at zero=0."""


class RuleStep(abc.ABC):
    """A rule's step over the tensors it was built on (each tensor's `.grad` is its final grad)."""

    @abc.abstractmethod
    def adopt(self, weights: torch.Tensor, views: dict[str, torch.Tensor]) -> None:
        """Keep the state of `weights` in `views` ({state name: tensor shaped like weights}), which the
        strategy owns (ZeRO: 1-D views of its flat state; a load: tensors the checkpoint is read into)."""

    @abc.abstractmethod
    def state_of(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-element state of `weights` made so far, by name (empty before the first step)."""

    @abc.abstractmethod
    def set_step(self, weights: torch.Tensor, step: int) -> None:
        """The step count of `weights` after a load (bias corrections read it)."""

    @abc.abstractmethod
    def step(self, lr: float, divisor: torch.Tensor, skip: torch.Tensor) -> None:
        """One update: grads divided by `divisor` (the clip), nothing changed where `skip` is 1 (a non-finite
        grad norm, checked on the device without a host sync)."""

    def writes_low(self, weights: torch.Tensor) -> bool:
        """Whether the step writes `weights.low` (the param's low-precision copy a strategy sets on an fp32
        master) itself; else the strategy casts the master into it after the step."""
        return False

    @abc.abstractmethod
    def held(self) -> list[torch.Tensor]:
        """Every state tensor this step holds (the save guard checks them, memory figures count them)."""


@dataclass(frozen=True)
class UpdateRule:
    """One update rule (module doc). Registered in optim/rule_registry.py, chosen by optim.name."""

    name: str
    states: tuple[str, ...]
    """Per-element state names, in the order checkpoints write them (optim/<state>/<param>)."""
    state_bytes: Mapping[str, tuple[int, ...]]
    """Bytes per element of each state (in `states` order), by optim.state_dtype ("fp32", "bf16")."""
    elementwise: bool
    """True when an update of any flat range equals the same range of the whole parameter's update."""
    build: Callable[..., RuleStep]
    """Its step over parameter groups (Groups), with the run's optim config, on the params' device, and
    the mesh when the strategy passes whole parameters (a rule gathering tp slices reads it)."""
    kinds: Mapping[str, tuple[str, ...]] | None = None
    """The names each kind of parameter holds: "hidden" (Placement.hidden_matrix: a hidden layer's 2-D
    weight, per expert) and "other"; None: every element holds every name (an elementwise rule)."""

    def states_for(self, placement) -> tuple[str, ...]:
        """The state names a parameter of this Placement holds."""
        if self.kinds is None:
            return self.states
        return self.kinds["hidden" if placement.hidden_matrix else "other"]

    def bytes_per_element(self, dtype: str = "fp32", placement=None, kind: str | None = None) -> int:
        """State bytes per parameter element of a parameter of `placement` (or of `kind`, "hidden" or
        "other"; neither: every name's, the most); the fp32 master a strategy may keep is not the rule's."""
        if placement is not None:
            names = self.states_for(placement)
        else:
            names = self.kinds[kind] if kind is not None and self.kinds is not None else self.states
        return sum(b for k, b in zip(self.states, self.state_bytes[dtype]) if k in names)
