"""Three-outcome verdicts from bootstrap intervals (docs/methods.md, "Uncertainty").

A claim is a statement about a difference ``d`` (``d > 0`` or ``d >= 0``, e.g. ``M(n,o) -
M(o,o)``): it is *held* when the interval of ``d`` excludes the opposite, *not held* when it
excludes the claim, and *inconclusive* when it contains both. A claim made of several checks
(every test set, every scenario) is held when every check is held and not held as soon as one
check is not held; a claim that needs one check among several (``any``) is held when one is
held and not held when every one is not held.
"""

from __future__ import annotations

from collections.abc import Sequence

from raycompat.metrics.bootstrap import Interval

__all__ = [
    "HELD",
    "INCONCLUSIVE",
    "NOT_HELD",
    "NOT_MEASURED",
    "combine_all",
    "combine_any",
    "verdict",
]

HELD, NOT_HELD, INCONCLUSIVE, NOT_MEASURED = "held", "not held", "inconclusive", "not measured"


def verdict(difference: Interval, strict: bool = True) -> str:
    """The verdict on ``d > 0`` (``strict``) or ``d >= 0`` from the interval of ``d``.

    ``d > 0``: held when ``low > 0``, not held when ``high <= 0``. ``d >= 0``: held when
    ``low >= 0``, not held when ``high < 0``. A NaN bound (an undefined statistic) and an
    interval refused for too many undefined resamples (:attr:`Interval.refused`) give
    inconclusive."""
    low, high = difference.low, difference.high
    if low != low or high != high or difference.refused:
        return INCONCLUSIVE
    if (low > 0) if strict else (low >= 0):
        return HELD
    if (high <= 0) if strict else (high < 0):
        return NOT_HELD
    return INCONCLUSIVE


def combine_all(verdicts: Sequence[str]) -> str:
    """Every check must hold: held if all are held, not held if one is not held; not
    measured when no check was (a check that was not measured makes the rest inconclusive)."""
    if all(v == NOT_MEASURED for v in verdicts):
        return NOT_MEASURED
    if NOT_HELD in verdicts:
        return NOT_HELD
    return HELD if all(v == HELD for v in verdicts) else INCONCLUSIVE


def combine_any(verdicts: Sequence[str]) -> str:
    """One check must hold: held if one is held, not held if every one is not held; not
    measured when no check was."""
    if all(v == NOT_MEASURED for v in verdicts):
        return NOT_MEASURED
    if HELD in verdicts:
        return HELD
    return NOT_HELD if all(v == NOT_HELD for v in verdicts) else INCONCLUSIVE
