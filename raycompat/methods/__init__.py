"""Compatible-training methods: one module per method, all behind one registry.

``build_method(name, options, context)`` is the factory the training loop uses.

Methods (docs/methods.md, Training objectives): ``independent``, ``l2`` and ``bct``,
``contrastive`` and ``ract``, ``dmu``, ``mcl`` with its baselines ``rqt`` and ``cl``
(base class in ``rank_merge``), ``p2s``, ``ndpp`` and ``odpp``; the field's baselines
(docs/methods.md, Field methods) ``lwf``, ``fd``, ``lce``, ``unibct``, ``advbct``, ``bt2``,
``dsimplex`` and ``fct``. Pieces written once:
``gathered`` (global-batch contrastive logits and the multi-worker loss conventions),
``prototypes`` (distributed per-class means) and, in ``raycompat.models``, the ArcFace /
CosFace margin (``margin_logits``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from raycompat.config import ConfigError, parse_options

# the imports register the methods
from raycompat.methods import (  # noqa: F401
    advbct,
    bct,
    bt2,
    cl,
    contrastive,
    dmu,
    dsimplex,
    fct,
    fd,
    independent,
    l2,
    lce,
    lwf,
    mcl,
    ndpp,
    odpp,
    p2s,
    ract,
    rqt,
    unibct,
)
from raycompat.methods.base import (
    CompatMethod,
    MethodContext,
    TrainBatch,
    TrainingModule,
    available_methods,
    register_method,
)


def method_class(name: str) -> type[CompatMethod]:
    methods = available_methods()
    if name not in methods:
        raise ConfigError(f"unknown method {name!r}; allowed methods: {sorted(methods)}")
    return methods[name]


def parse_method_options(name: str, options: Mapping[str, Any] | None):
    return parse_options(method_class(name).Options, options, owner=f"method {name}")


def build_method(
    name: str, options: Mapping[str, Any] | None, context: MethodContext
) -> CompatMethod:
    cls = method_class(name)
    if cls.needs_old_model and context.old is None:
        raise ConfigError(f"method {name!r} needs an old model (--old-model PATH)")
    return cls(parse_method_options(name, options), context)


__all__ = [
    "CompatMethod",
    "MethodContext",
    "TrainBatch",
    "TrainingModule",
    "available_methods",
    "register_method",
    "method_class",
    "parse_method_options",
    "build_method",
]
