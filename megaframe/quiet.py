"""Loader noise of optional packages, silenced where megaframe does not use them.

transformers imports torchao whenever it is installed; torchao then logs a warning for each compiled kernel
library its wheel cannot load here (`Failed to load .../_C_mxfp8...so`), and torch's pytree logs a
deprecation for torchao's enums. A user exporting a checkpoint, or training in fp32, is told nothing they can
act on, and cannot tell whether to worry. An fp8 run imports torchao itself (layers/fp8.py), first.
"""

from __future__ import annotations

import logging
import sys

NOISY = ("torchao", "torch.utils._pytree")


def quiet_optional_imports() -> None:
    """Raise the noisy loggers to ERROR unless torchao is
    already loaded (an fp8 run's own import keeps them)."""
    if "torchao" in sys.modules:
        return
    for name in NOISY:
        logging.getLogger(name).setLevel(logging.ERROR)
