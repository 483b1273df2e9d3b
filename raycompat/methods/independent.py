"""``independent``: the paragon new* (and every old model): L_cls only
(docs/methods.md, Training objectives)."""

from __future__ import annotations

from dataclasses import dataclass

from raycompat.methods.base import CompatMethod, register_method


@register_method
class Independent(CompatMethod):
    name = "independent"
    description = "no compatibility term (paragon new*, and how old models are trained)"
    needs_old_model = False

    @dataclass
    class Options:
        lambda_compat: float = 0.0
