"""Classification heads: softmax, CosFace, ArcFace and the fixed d-Simplex (docs/methods.md,
Classification heads).

The cosine heads share one normalised weight matrix (``CosineClassifier``) and differ
only in the margin they put on the target logit, written once in ``margin_logits``. The
``dsimplex`` head (CoReS, Biondi et al., TPAMI 2023) is not trained: its rows are vertices of a
regular simplex, shared by every generation of a model (``simplex_vertices``,
``continued_vertices``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from raycompat.config import ConfigError

HEAD_DEFAULTS = {
    "softmax": dict(),
    "cosface": dict(scale=32.0, margin=0.4),  # BCT faces
    "arcface": dict(scale=30.0, margin=0.3),  # DMU landmarks
    "dsimplex": dict(),  # fixed simplex rows, K = embed_dim + 1 vertices
}


def simplex_vertices(num_vertices: int) -> torch.Tensor:
    """The ``K`` unit vertices of a regular simplex in ``R^(K-1)`` (float32 ``[K, K-1]``):
    ``I_{K-1}`` with a row of ``(1 - sqrt(K)) / (K - 1)`` appended, centred (column mean
    subtracted) and row-normalised; every pair of rows has cosine ``-1 / (K - 1)``."""
    k = int(num_vertices)
    if k < 2:
        raise ValueError(f"a simplex needs at least 2 vertices, got {k}")
    rows = torch.eye(k - 1, dtype=torch.float64)
    extra = torch.full((1, k - 1), (1.0 - math.sqrt(k)) / (k - 1), dtype=torch.float64)
    rows = torch.cat([rows, extra])
    rows = rows - rows.mean(dim=0, keepdim=True)
    return F.normalize(rows, dim=1).float()


def check_simplex_size(embed_dim: int, num_classes: int, what: str) -> None:
    """A ``dsimplex`` head has ``K = embed_dim + 1`` vertices, one per class it will ever know;
    ``ConfigError`` naming ``what`` when ``num_classes`` do not fit."""
    if num_classes > embed_dim + 1:
        raise ConfigError(
            f"head dsimplex with embed_dim {embed_dim} has K = {embed_dim + 1} simplex vertices, "
            f"but {what} has {num_classes} classes: pass --embed-dim {num_classes - 1} or more"
        )


def continued_vertices(
    new_classes: list[int], old_classes: list[int] = (), old_vertices: list[int] | None = None
) -> list[int]:
    """The simplex label ``y`` of every new head row: a class the predecessor's ``dsimplex`` head
    knows keeps its label (``old_vertices``, per row of ``old_classes``); the others take the
    next free labels in row order (class labels in order of arrival, as CoReS numbers them)."""
    known = dict(zip(old_classes, old_vertices or [], strict=False))
    following = max(known.values(), default=-1) + 1
    out = []
    for c in new_classes:
        if c not in known:
            known[c] = following
            following += 1
        out.append(known[c])
    return out


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

    ``kind`` is softmax (plain FC), cosface, arcface or dsimplex. ``cosine(emb)`` gives the
    margin-free cosine logits used for uncertainty (RACT Eq.9-11) and DMU's discriminativeness.
    A ``dsimplex`` head has ``K = embed_dim + 1`` simplex vertices; row ``r`` is the fixed
    vertex ``K - 1 - vertices[r]`` (written from the bottom, as CoReS does), a buffer, not a
    parameter. Its training logits are ``W e`` over all ``K`` vertices on the unnormalised
    embedding: the head's rows first (so a class's target is its row), then the vertices kept
    for classes still to come, which the softmax counts as negatives (CoReS's ``Linear(K-1, K)``;
    docs/methods.md, "d-Simplex"). Its inference logits cover its own rows only.
    """

    def __init__(
        self,
        embed_dim: int,
        num_classes: int,
        kind: str = "softmax",
        scale: float | None = None,
        margin: float | None = None,
        vertices: list[int] | None = None,
    ):
        super().__init__()
        if kind not in HEAD_DEFAULTS:
            raise ValueError(f"unknown head {kind!r}; allowed: {sorted(HEAD_DEFAULTS)}")
        defaults = HEAD_DEFAULTS[kind]
        self.kind = kind
        self.scale = float(scale if scale is not None else defaults.get("scale", 1.0))
        self.margin = float(margin if margin is not None else defaults.get("margin", 0.0))
        self.spec = dict(
            type="head",
            embed_dim=embed_dim,
            num_classes=num_classes,
            kind=kind,
            scale=self.scale,
            margin=self.margin,
        )
        if kind == "dsimplex":
            self.vertices = self._check_vertices(embed_dim, num_classes, vertices)
            every = simplex_vertices(embed_dim + 1)
            self.register_buffer("weight", every[[embed_dim - y for y in self.vertices]])
            taken = set(self.vertices)
            future = [embed_dim - y for y in range(embed_dim + 1) if y not in taken]
            # derived from the vertices, so not saved: bundles keep their state dicts
            self.register_buffer("future_weight", every[future], persistent=False)
            self.bias = None
            self.spec["vertices"] = list(self.vertices)
            return
        self.weight = nn.Parameter(torch.empty(num_classes, embed_dim))
        nn.init.normal_(self.weight, std=0.01)
        self.bias = nn.Parameter(torch.zeros(num_classes)) if kind == "softmax" else None

    @staticmethod
    def _check_vertices(embed_dim: int, num_classes: int, vertices) -> list[int]:
        """The simplex label of every row: distinct, in ``[0, K)``, ``K = embed_dim + 1``."""
        k = embed_dim + 1
        vertices = list(range(num_classes)) if vertices is None else [int(v) for v in vertices]
        if len(vertices) != num_classes or len(set(vertices)) != num_classes:
            raise ValueError(f"dsimplex head: {num_classes} rows need {num_classes} labels")
        if vertices and not 0 <= min(vertices) <= max(vertices) < k:
            raise ValueError(
                f"dsimplex head: embed_dim {embed_dim} gives K = {k} simplex vertices, but a "
                f"class needs vertex label {max(vertices)}: use embed_dim >= {max(vertices)}"
            )
        return vertices

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
        """Training logits. ``weight`` overrides the rows (e.g. BCT-sys synthesised classes);
        a ``dsimplex`` head's logits over its own rows are followed by those of its free
        vertices (the softmax runs over all ``K``; a class's target is still its row)."""
        if self.kind == "dsimplex":
            if weight is None:
                weight = torch.cat([self.weight, self.future_weight])
            return F.linear(emb, weight)
        if self.kind == "softmax":
            w = self.weight if weight is None else weight
            bias = self.bias
            if bias is not None and w.shape[0] != bias.shape[0]:
                bias = torch.cat([bias, bias.new_zeros(w.shape[0] - bias.shape[0])])
            return F.linear(emb, w, bias)
        return margin_logits(self.cosine(emb, weight), labels, self.kind, self.scale, self.margin)

    def inference_logits(self, emb: torch.Tensor) -> torch.Tensor:
        """Margin-free logits: ``s * cos`` for cosine heads, the FC output for softmax and
        dsimplex."""
        if self.kind in ("softmax", "dsimplex"):
            return F.linear(emb, self.weight, self.bias)
        return self.scale * self.cosine(emb)
