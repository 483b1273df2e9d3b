"""Classification heads: softmax, CosFace, ArcFace (docs/methods.md, Classification heads).

The cosine heads share one normalised weight matrix (``CosineClassifier``) and differ
only in the margin they put on the target logit, written once in ``margin_logits``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

HEAD_DEFAULTS = {
    "softmax": dict(),
    "cosface": dict(scale=32.0, margin=0.4),  # BCT faces
    "arcface": dict(scale=30.0, margin=0.3),  # DMU landmarks
}


def margin_logits(
    cos: torch.Tensor, labels: torch.Tensor | None, kind: str, scale: float, margin: float
) -> torch.Tensor:
    """Scaled cosine logits with the target margin of CosFace (s*(cos-m)) or ArcFace
    (s*cos(theta+m)).

    ``labels`` entries < 0 get no margin (samples whose class the head does not know).
    """
    if labels is None or margin == 0.0:
        return scale * cos
    known = labels >= 0
    target_index = labels.clamp(min=0).unsqueeze(1)
    target_cos = cos.gather(1, target_index).squeeze(1)
    if kind == "cosface":
        target_new = target_cos - margin
    elif kind == "arcface":
        # cos(theta + m), with the usual easy-margin fallback once theta + m > pi.
        sin = torch.sqrt((1.0 - target_cos.pow(2)).clamp(min=1e-9))
        shifted = target_cos * math.cos(margin) - sin * math.sin(margin)
        threshold = math.cos(math.pi - margin)
        target_new = torch.where(
            target_cos > threshold, shifted, target_cos - math.sin(math.pi - margin) * margin
        )
    else:
        raise ValueError(f"unknown margin kind {kind!r}")
    target_new = torch.where(known, target_new, target_cos)
    out = cos.scatter(1, target_index, target_new.unsqueeze(1).to(cos.dtype))
    return scale * out


class ClassifierHead(nn.Module):
    """A classifier over ``num_classes`` classes: ``forward(emb, labels)`` -> training logits.

    ``kind`` is softmax (plain FC), cosface or arcface. ``cosine(emb)`` gives the margin-free
    cosine logits used for uncertainty (RACT Eq.9-11) and DMU's discriminativeness.
    """

    def __init__(
        self,
        embed_dim: int,
        num_classes: int,
        kind: str = "softmax",
        scale: float | None = None,
        margin: float | None = None,
    ):
        super().__init__()
        if kind not in HEAD_DEFAULTS:
            raise ValueError(f"unknown head {kind!r}; allowed: {sorted(HEAD_DEFAULTS)}")
        defaults = HEAD_DEFAULTS[kind]
        self.kind = kind
        self.scale = float(scale if scale is not None else defaults.get("scale", 1.0))
        self.margin = float(margin if margin is not None else defaults.get("margin", 0.0))
        self.weight = nn.Parameter(torch.empty(num_classes, embed_dim))
        nn.init.normal_(self.weight, std=0.01)
        self.bias = nn.Parameter(torch.zeros(num_classes)) if kind == "softmax" else None
        self.spec = dict(
            type="head",
            embed_dim=embed_dim,
            num_classes=num_classes,
            kind=kind,
            scale=self.scale,
            margin=self.margin,
        )

    @property
    def num_classes(self) -> int:
        return self.weight.shape[0]

    def cosine(self, emb: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weight if weight is None else weight
        return F.linear(F.normalize(emb, dim=-1), F.normalize(w, dim=-1))

    def forward(
        self,
        emb: torch.Tensor,
        labels: torch.Tensor | None = None,
        weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Training logits. ``weight`` overrides the rows (e.g. BCT-sys synthesised classes)."""
        if self.kind == "softmax":
            w = self.weight if weight is None else weight
            bias = self.bias
            if bias is not None and w.shape[0] != bias.shape[0]:
                bias = torch.cat([bias, bias.new_zeros(w.shape[0] - bias.shape[0])])
            return F.linear(emb, w, bias)
        return margin_logits(self.cosine(emb, weight), labels, self.kind, self.scale, self.margin)

    def inference_logits(self, emb: torch.Tensor) -> torch.Tensor:
        """Margin-free logits: ``s * cos`` for cosine heads, the FC output for softmax."""
        if self.kind == "softmax":
            return F.linear(emb, self.weight, self.bias)
        return self.scale * self.cosine(emb)
