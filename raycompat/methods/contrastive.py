"""``contrastive``: vanilla compatible training (RACT Eq.5; docs/methods.md, Training objectives).

``L_comp(x_i) = -log exp(s(n_i,o_i)/tau)
/ (exp(s(n_i,o_i)/tau) + sum_{k not in p(i)} exp(s(n_i,o_k)/tau))``
with ``n = phi_n(x)[:D_o]``, ``o = phi_o(x)``, both L2-normalised, tau=0.05, and ``k`` over the
*global* batch (gathered from every DDP worker, the local part keeping its gradient; see
``gathered``). ``form=triplet``: the appendix Eq.14 with the sign docs/methods.md corrects,
``mean_k max(0, s(n_i,o_k) - s(n_i,o_i) + m)``, m=0.8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from raycompat.config import choices, nonnegative, positive
from raycompat.methods.base import CompatMethod, TrainBatch, register_method
from raycompat.methods.gathered import (
    compatibility_logits,
    compatibility_triplet,
    gather,
    global_batch_loss,
)


@register_method
class Contrastive(CompatMethod):
    name = "contrastive"
    description = (
        "vanilla compatible training (RACT Eq.5): new-to-old negatives over the global batch"
    )
    # RACT adds the new-to-new negatives block (Eq.6).
    new_to_new: ClassVar[bool] = False

    @dataclass
    class Options:
        form: str = choices("contrastive", "triplet", default="contrastive")
        lambda_compat: float = nonnegative(1.0)
        tau: float = positive(0.05)
        margin: float = nonnegative(0.8)

    def compat_loss(self, model, batch: TrainBatch, emb: torch.Tensor) -> dict[str, torch.Tensor]:
        old = F.normalize(self.old_features(batch.x_old), dim=1)
        part = F.normalize(self.compatible_part(emb), dim=1)
        # New-to-new similarities use the whole new embedding, as new-to-new search does.
        full = F.normalize(emb, dim=1) if self.new_to_new else None
        labels, part, old, full = gather(batch.labels, part, old, full)
        if self.options.form == "contrastive":
            logits = compatibility_logits(part, old, labels, self.options.tau, full)
            loss = F.cross_entropy(logits, torch.zeros_like(labels))
        else:
            loss = compatibility_triplet(part, old, labels, self.options.margin, full).mean()
        return {"compat": global_batch_loss(loss)}
