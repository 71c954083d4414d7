"""A numeric value's rule (Rule: range, finiteness, integer or not; Either of two), the named ones the
tables share (POS, UNIT, SEED, TIMEOUT...), how a rule reads as a phrase, and a tool's typed option
checked by one (check_option). `_req`: the one-line ConfigError every cross-field rule raises (each
package's own rules beside it use it: parallel/layout_rules.py, models/shape_rules.py, ...). A leaf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megaframe.errors import ConfigError


def _req(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


@dataclass(frozen=True)
class Rule:
    """Allowed values of one numeric field: lo <= v (lo < v when lo_open), v < hi (v <= hi when not
    hi_open), always finite; None only when `optional`; `integer` refuses a fraction (and a bool)."""

    lo: float | None = None
    lo_open: bool = False
    hi: float | None = None
    hi_open: bool = True
    optional: bool = False
    integer: bool = False
    bound: str = ""
    """Why the upper bound is what it is, said after it (a bound tied to the machine names the machine)."""

    def why(self, v) -> str | None:
        if v is None:
            return None if self.optional else "must be set"
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or (self.integer and not float(v).is_integer())
        ):
            return f"must be {'an integer' if self.integer else 'a number'}"
        if not math.isfinite(v):
            return "must be finite"
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return f"must be {'>' if self.lo_open else '>='} {self.lo:g}"
        if self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi):
            return f"must be {'<' if self.hi_open else '<='} {self.hi:g}{self.bound}"
        return None


def _r(lo=None, *, gt=False, hi=None, le=False, opt=False, int_=True, bound="") -> Rule:
    return Rule(lo, gt, hi, not le, opt, int_, bound)


POS, NONNEG = _r(1), _r(0)  # integer counts and sizes
POSF, NONNEGF = _r(0, gt=True, int_=False), _r(0, int_=False)  # finite real numbers
UNIT = _r(0, hi=1, int_=False)  # a fraction in [0, 1)
PART = _r(0, gt=True, hi=1, int_=False)  # a proper part of a whole, in (0, 1)
SHARE = _r(0, gt=True, hi=1, le=True, int_=False)  # a share of a peak, in (0, 1]
SEED = _r(0, hi=2**63)  # numpy and torch take a non-negative int64 seed
# a process-group timeout is a datetime.timedelta
# (at most ~8.6e13 s): a "switch it off" 1e30 overflowed at start
TIMEOUT = _r(0, gt=True, hi=1e9, le=True, int_=False)

# The tools' own numeric options (evaluate's +batch_size, the planner's +world_size, a device profile's
# figures, generate's --top-p) are checked by the same Rules, each tool holding a table of its options:
# a typed text is parsed here, so "abc", "nan", "-1" and "1e9" are judged alike in every tool.


@dataclass(frozen=True)
class Either:
    """A value any of `rules` allows (lm-eval's limit: a fraction of the documents, or a whole count)."""

    rules: tuple[Rule, ...]
    optional: bool = False

    def why(self, v) -> str | None:
        if v is None and self.optional:
            return None
        reasons = [r.why(v) for r in self.rules]
        return None if None in reasons else f"must be {self.describe()}"

    def describe(self) -> str:
        return " or ".join(describe(r) for r in self.rules)


def describe(rule: Rule | Either) -> str:
    """What a rule allows, as a phrase: `an integer >= 1`, `a finite number > 0 and <= 1`."""
    if isinstance(rule, Either):
        return rule.describe()
    # an integer's bound in full (a seed's 2**63, not 9.22337e+18)
    num = (lambda x: str(int(x))) if rule.integer else (lambda x: f"{x:g}")
    bounds = []
    if rule.lo is not None:
        bounds.append(f"{'>' if rule.lo_open else '>='} {num(rule.lo)}")
    if rule.hi is not None:
        bounds.append(f"{'<' if rule.hi_open else '<='} {num(rule.hi)}")
    kind = "an integer" if rule.integer else "a finite number"
    return " and ".join([f"{kind} {bounds[0]}" if bounds else kind, *bounds[1:]])


def as_number(value) -> int | float | None:
    """A typed option as a number: an int when it reads as one (also `1e3`, a whole float), else a float;
    None when it is not a number at all (`abc`, `auto`, a bool, a list)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return value
    text = str(value).strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        v = float(text)
    except ValueError:
        return None
    return int(v) if math.isfinite(v) and v.is_integer() and abs(v) < 2**63 else v


def check_option(shown: str, value, rule: Rule | Either):
    """A tool option's value (a number, or the text the user typed) checked by `rule`: the number (an int
    for an integer rule, a float for a real one), or None for an optional one not given. ConfigError
    `<shown> must be <what the rule allows>`, where `shown` is the option as the user typed it
    (`+batch_size=-1`, `--top-p 2`)."""
    if value is None and rule.optional:
        return None
    v = as_number(value)
    if v is None or rule.why(v) is not None:
        raise ConfigError(f"{shown} must be {describe(rule)}")
    if isinstance(rule, Either):  # lm-eval's limit: an int is a count, a float a fraction
        return v
    return int(v) if rule.integer else float(v)


def check_options(given: dict, table: dict[str, Rule | Either], shown) -> dict:
    """Every option of `given` that `table` names, checked (check_option) and parsed; `shown(key, value)`
    is how the tool's user typed it. The other options come back as they were."""
    return {k: check_option(shown(k, v), v, table[k]) if k in table else v for k, v in given.items()}
