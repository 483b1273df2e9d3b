"""The new model's classifier head as plain arrays, the ``head`` of a policy's inputs
(:class:`~raycompat.upgrade.policies.base.PolicyInputs`): the uncertainty policies and the
learned policy's uncertainty features read it (RACT Sec. 4.3; docs/methods.md, "Backfill
policies")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raycompat.embeddings.gallery import BackfillInputError

__all__ = ["UncertaintyHead"]


@dataclass
class UncertaintyHead:
    """The new classifier ``w_n`` as plain arrays, applied to old gallery features.

    ``kind``: ``softmax`` (logits ``f W^T + b``) or a cosine head ``cosface`` /
    ``arcface`` (margin-free inference logits ``scale * cos(f, w)``), as
    :meth:`raycompat.models.ClassifierHead.inference_logits`.

    Dimension change: the old feature has ``D_old`` dims and the head expects
    ``D_new >= D_old``.  The old feature is compatible with the first ``D_old``
    dims of the new space (BCT), so the logits use the first ``D_old`` columns of
    ``W`` (for cosine heads the truncated rows are re-normalised).
    """

    weight: np.ndarray
    bias: np.ndarray | None = None
    kind: str = "softmax"
    scale: float = 1.0

    @classmethod
    def from_classifier_head(cls, head) -> UncertaintyHead:
        w = head.weight.detach().cpu().numpy().astype(np.float64)
        b = (
            head.bias.detach().cpu().numpy().astype(np.float64)
            if getattr(head, "bias", None) is not None
            else None
        )
        return cls(weight=w, bias=b, kind=head.kind, scale=float(getattr(head, "scale", 1.0)))

    def logits(self, features: np.ndarray) -> np.ndarray:
        """float64 inference logits ``[n, C]`` of (old) features ``[n, D_old]``."""
        f = np.asarray(features, dtype=np.float64)
        d = f.shape[1]
        if d > self.weight.shape[1]:
            raise BackfillInputError(
                f"dimension mismatch: old features have {d} dims, "
                f"the new head only {self.weight.shape[1]}"
            )
        w = self.weight[:, :d]
        if self.kind == "softmax":
            out = f @ w.T
            return out + self.bias[None, :] if self.bias is not None else out
        fn = f / np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-12)
        wn = w / np.maximum(np.linalg.norm(w, axis=1, keepdims=True), 1e-12)
        return self.scale * (fn @ wn.T)
