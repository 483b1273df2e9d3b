"""Backward-compatibility scores between an old and a new embedding model.

Specification: docs/methods.md, section "Metrics".  Notation ``M(query, gallery)``:

* ``m_oo``    = M(old, old)       -- the old system
* ``m_no``    = M(new, old)       -- cross-model (compatibility) test
* ``m_nn``    = M(new, new)       -- the compatible new model's self-test
* ``m_nstar`` = M(new*, new*)     -- the paragon: new model trained without any
  compatibility term, gallery fully backfilled (upper bound).

Every function accepts python scalars or numpy arrays (broadcast elementwise)
and returns a python float for scalar inputs, a float64 array otherwise.
Divisions by zero never raise: the result is ``nan`` (undefined), documented
per function.  Metrics can be fractions or percentages as long as all
arguments use the same scale (every score here is a ratio).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "update_gain",
    "is_compatible",
    "delta_up",
    "delta_down",
    "p_scores",
    "compatibility_report",
]


def _arr(x, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if np.isinf(a).any():
        raise ValueError(f"{name} contains inf")
    return a


def _out(a: np.ndarray, *inputs):
    if all(np.ndim(i) == 0 for i in inputs):
        return float(a)
    return a


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den with nan where den == 0 (no warning, no exception)."""
    num, den = np.broadcast_arrays(num, den)
    out = np.full(num.shape, np.nan, dtype=np.float64)
    ok = den != 0
    np.divide(num, den, out=out, where=ok)
    return out


def update_gain(m_no, m_oo, m_nstar):
    """Update gain, BCT Eq.9: ``(M(n,o) - M(o,o)) / (M(n*,n*) - M(o,o))``.

    The fraction of the full-backfill improvement obtained without backfilling
    (1.0 = 100%).  BCT notes it is only meaningful when the compatibility
    criterion :func:`is_compatible` holds; it is returned regardless.
    When ``M(n*,n*) == M(o,o)`` the gain is undefined and ``nan`` is returned.
    """
    a, b, c = _arr(m_no, "m_no"), _arr(m_oo, "m_oo"), _arr(m_nstar, "m_nstar")
    return _out(_safe_div(a - b, c - b), m_no, m_oo, m_nstar)


def is_compatible(m_no, m_oo):
    """Empirical compatibility criterion (BCT Eq.2; docs/methods.md, Metrics): ``M(n,o) > M(o,o)``.

    Strict inequality; ``nan`` inputs give ``False``.  Returns a python bool
    for scalar inputs, a bool array otherwise.
    """
    a, b = _arr(m_no, "m_no"), _arr(m_oo, "m_oo")
    res = a > b
    if np.ndim(m_no) == 0 and np.ndim(m_oo) == 0:
        return bool(res)
    return res


def delta_up(m_no, m_oo):
    """Delta_up, DMU Eq.6: ``(M(n,o) - M(o,o)) / M(o,o)`` (relative gain of the
    cross test over the old system; > 0 means compatible).  ``nan`` when
    ``M(o,o) == 0``."""
    a, b = _arr(m_no, "m_no"), _arr(m_oo, "m_oo")
    return _out(_safe_div(a - b, b), m_no, m_oo)


def delta_down(m_nn, m_nstar):
    """Delta_down, DMU Eq.7: ``(M(n*,n*) - M(n,n)) / M(n*,n*)`` (relative loss of
    the compatible new model against the paragon; lower is better).  ``nan``
    when ``M(n*,n*) == 0``."""
    a, c = _arr(m_nn, "m_nn"), _arr(m_nstar, "m_nstar")
    return _out(_safe_div(c - a, c), m_nn, m_nstar)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def p_scores(m_nn, m_nstar, m_no, m_oo) -> dict[str, float]:
    """P_up / P_comp / P_1 (NDPP Tables II-IV, after AdvBCT), over test sets d.

    Per test set d::

        u_d = sigmoid((M(n,n) - M(n*,n*)) / M(n*,n*))
        v_d = sigmoid((M(n,o) - M(o,o)) / (M(n*,n*) - M(o,o)))

    ``P_up = 100*mean(u)``, ``P_comp = 100*mean(v)``,
    ``P_1 = 100*mean(2*u*v/(u+v))`` (harmonic mean per test set, then averaged:
    this reproduces NDPP Table II, e.g. BCT data-extension 47.75 / 55.34 / 51.23,
    whereas the harmonic mean of the two averages would give 51.26).

    Args: 1-D arrays (or scalars for a single test set), one entry per test set.

    Returns:
        ``{"P_up", "P_comp", "P_1"}`` as python floats, in percent.  A test set
        with ``M(n*,n*) == 0`` (u undefined) or ``M(n*,n*) == M(o,o)`` (v
        undefined) has a ``nan`` term, and ``nan`` propagates to the affected
        averages: the score over a set of benchmarks is undefined if one of
        them is.
    """
    nn, ns = _arr(m_nn, "m_nn").ravel(), _arr(m_nstar, "m_nstar").ravel()
    no, oo = _arr(m_no, "m_no").ravel(), _arr(m_oo, "m_oo").ravel()
    shapes = {nn.shape, ns.shape, no.shape, oo.shape}
    if len(shapes) != 1:
        raise ValueError(
            f"all four inputs need one value per test set, got shapes {sorted(shapes)}"
        )
    if nn.size == 0:
        raise ValueError("p_scores needs at least one test set")
    u = _sigmoid(_safe_div(nn - ns, ns))
    v = _sigmoid(_safe_div(no - oo, ns - oo))
    f1 = _safe_div(2.0 * u * v, u + v)
    return {
        "P_up": float(100.0 * u.mean()),
        "P_comp": float(100.0 * v.mean()),
        "P_1": float(100.0 * f1.mean()),
    }


def compatibility_report(m_oo, m_no, m_nn, m_nstar) -> dict[str, float]:
    """All scalar compatibility scores for one metric on one test set.

    Keys: ``compatible`` (1.0 / 0.0, BCT criterion), ``update_gain`` (BCT Eq.9),
    ``delta_up`` / ``delta_down`` (DMU Eq.6/7), ``P_up`` / ``P_comp`` / ``P_1``
    (NDPP, single test set).  Undefined values are ``nan`` (see each function).
    """
    scalars = (m_oo, m_no, m_nn, m_nstar)
    if any(np.ndim(x) != 0 for x in scalars):
        raise ValueError("compatibility_report takes scalar metric values")
    rep = {
        "compatible": float(is_compatible(m_no, m_oo)),
        "update_gain": update_gain(m_no, m_oo, m_nstar),
        "delta_up": delta_up(m_no, m_oo),
        "delta_down": delta_down(m_nn, m_nstar),
    }
    rep.update(p_scores(m_nn, m_nstar, m_no, m_oo))
    return rep
