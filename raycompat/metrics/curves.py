"""Backfill-curve metrics: AUC, AUC gain and regression statistics.

A backfill curve is a metric evaluated at backfill fractions ``t`` (share of
the gallery holding the new model's embedding), on a grid from 0 to 1.
Specification: docs/methods.md, section "Metrics" ("Regression", "AUC", "AUC gain").
"""

from __future__ import annotations

import numpy as np

__all__ = ["auc", "auc_gain", "auc_gain_note", "regression_stats"]


def _curve(fractions, values) -> tuple[np.ndarray, np.ndarray]:
    t = np.asarray(fractions, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if t.ndim != 1 or v.ndim != 1 or t.shape != v.shape:
        raise ValueError(
            f"fractions and values must be 1-D of equal length, got {t.shape} and {v.shape}"
        )
    if t.size == 0:
        raise ValueError("empty curve")
    if not np.isfinite(t).all():
        raise ValueError("fractions contain NaN or inf")
    if np.isnan(v).any():
        raise ValueError("values contain NaN")
    if (t < 0).any() or (t > 1).any():
        raise ValueError(f"fractions must lie in [0, 1], got range [{t.min()}, {t.max()}]")
    if (np.diff(t) <= 0).any():
        raise ValueError("fractions must be strictly increasing")
    return t, v


def auc(fractions, values, *, require_full_range: bool = True) -> float:
    """Area under a backfill curve (RM paper: ``AUC_mAP = int_0^1 mAP_t dt``).

    Trapezoid rule on the evaluated grid (docs/methods.md, "Metrics": no
    interpolation beyond the grid points).

    Args:
        fractions: strictly increasing backfill fractions in [0, 1].
        values: metric at each fraction.
        require_full_range: the grid must start at t=0 and end at t=1 (default),
            otherwise ``ValueError``.  With ``False`` the integral covers only
            ``[t_0, t_last]`` (not normalised by its length).

    Returns:
        python float (in the metric's unit: a constant curve at 0.5 gives 0.5).
    """
    t, v = _curve(fractions, values)
    if require_full_range and (t[0] != 0.0 or t[-1] != 1.0):
        raise ValueError(
            f"AUC over backfill needs a grid from t=0 to t=1, got [{t[0]}, {t[-1]}] "
            "(pass require_full_range=False to integrate over the evaluated span only)"
        )
    if t.size == 1:
        return 0.0
    return float(np.sum((t[1:] - t[:-1]) * (v[1:] + v[:-1]) / 2.0))


def auc_gain(auc_method, auc_oldold, auc_newstar):
    """AUC gain, RM Table 1: ``(AUC(method) - AUC(old-old)) / (AUC(new*-new*) - AUC(old-old))``.

    A fraction (1.0 = 100%: the method's backfill curve is as good on average
    as using the paragon new model everywhere).  ``AUC(old-old)`` and
    ``AUC(new*-new*)`` are the areas of the flat curves of the old system and
    of the fully backfilled paragon (i.e. their metric values, when constant).
    ``nan`` (undefined) unless ``AUC(new*-new*) > AUC(old-old)``: with new* no
    better than old-old the denominator is <= 0 and the ratio's sign would flip
    (see :func:`auc_gain_note` for the reason to print).
    Scalars give a python float; arrays broadcast.
    """
    a = np.asarray(auc_method, dtype=np.float64)
    b = np.asarray(auc_oldold, dtype=np.float64)
    c = np.asarray(auc_newstar, dtype=np.float64)
    num, den = np.broadcast_arrays(a - b, c - b)
    out = np.full(num.shape, np.nan)
    np.divide(num, den, out=out, where=den > 0)
    if out.ndim == 0:
        return float(out)
    return out


def auc_gain_note(auc_oldold: float, auc_newstar: float) -> str | None:
    """Why the AUC gain (RM Table 1) is undefined for these references, or ``None`` if it is
    defined: its denominator ``AUC(new*-new*) - AUC(old-old)`` must be > 0.

    Values are printed as given (fractions in the JSON), e.g.
    ``"new*-new* (0.31) is not better than old-old (0.35)"``.
    """
    b, c = float(auc_oldold), float(auc_newstar)
    if not (np.isfinite(b) and np.isfinite(c)):
        return f"reference is not finite (new*-new* {c:.4g}, old-old {b:.4g})"
    if c > b:
        return None
    return f"new*-new* ({c:.4g}) is not better than old-old ({b:.4g})"


def regression_stats(fractions, values, higher_is_better: bool = True) -> dict[str, object]:
    """Model regression along a backfill curve (RACT Eq.3; docs/methods.md, Metrics, "Regression").

    RACT Eq.3 calls it regression when a partly backfilled gallery scores below
    the untouched old gallery, ``M(Q_new, G_new^t u G_old^(1-t)) < M(Q_new, G_old)``;
    docs/methods.md asks for both readings:

    * ``points_below_start``: fractions t > t_0 whose value is worse than the
      value at the first grid point (t=0): strictly lower when
      ``higher_is_better``, strictly higher otherwise (e.g. NFR, error rates).
    * ``drops``: every consecutive worsening ``(t_prev, t, drop)`` with
      ``drop > 0`` the size of the worsening (``v_prev - v`` when higher is
      better, ``v - v_prev`` otherwise).

    Also returned: ``max_drop`` (0.0 if none), ``max_below_start`` (largest
    shortfall against the start, 0.0 if none), ``has_regression`` (either list
    non-empty), ``start`` (the value at t_0).  Fractions and values are python
    floats.  The grid need not cover [0, 1]; "start" is its first point.
    """
    t, v = _curve(fractions, values)
    sign = 1.0 if higher_is_better else -1.0
    start = v[0]
    worse_than_start = sign * (start - v) > 0
    worse_than_start[0] = False
    step = sign * (v[:-1] - v[1:])  # > 0: worsening
    drops: list[tuple[float, float, float]] = [
        (float(t[i]), float(t[i + 1]), float(step[i])) for i in np.flatnonzero(step > 0)
    ]
    below: list[float] = [float(x) for x in t[worse_than_start]]
    shortfall = sign * (start - v[worse_than_start])
    return {
        "start": float(start),
        "points_below_start": below,
        "drops": drops,
        "max_drop": float(max((d[2] for d in drops), default=0.0)),
        "max_below_start": float(shortfall.max()) if shortfall.size else 0.0,
        "has_regression": bool(below or drops),
    }
