"""prepare's progress: a tqdm bar over the source bytes on a terminal, a line every 10 s in a log."""

from __future__ import annotations

import sys
import time


class Progress:
    """tqdm bar over source text bytes with tokens/s and ETA on a terminal; a line every 10 s otherwise."""

    def __init__(self, total: int, show: bool | None):
        from tqdm import tqdm

        show = sys.stderr.isatty() if show is None else show
        self.bar = tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc="tokenizing",
            disable=not show,
            leave=False,
            dynamic_ncols=True,
            smoothing=0.05,
        )
        self.lines, self.total, self.tokens, self.counted = not show, total, 0, 0
        self.t0 = self.t_line = time.perf_counter()
        self.worker_cpu = 0.0
        self.unit_left: dict[int, int] = {}

    def start_unit(self, k: int, size: int) -> None:
        self.unit_left[k] = size

    def update(self, k: int, chars: int, tokens: int) -> None:
        step = min(chars, self.unit_left[k])  # chars approximate bytes; a unit never overshoots its size
        self.unit_left[k] -= step
        self._advance(step, tokens)

    def unit_done(self, k: int) -> None:
        self._advance(self.unit_left.pop(k), 0)

    def _advance(self, nbytes: int, tokens: int) -> None:
        self.tokens += tokens
        self.counted += nbytes
        now = time.perf_counter()
        rate = self.tokens / max(now - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{rate / 1e3:,.0f}k tok/s", refresh=False)
        self.bar.update(nbytes)
        # a log file, not a terminal: a line every 10 s
        if self.lines and now - self.t_line > 10 and self.counted:
            eta = (now - self.t0) * (self.total - self.counted) / self.counted
            print(
                f"megaframe: prepare: {self.counted / max(self.total, 1):.0%} of the source, "
                f"{self.tokens:,} tokens, {rate:,.0f} tokens/s, eta {eta:.0f}s",
                flush=True,
            )
            self.t_line = now

    def close(self) -> None:
        self.bar.close()
