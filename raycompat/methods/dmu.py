"""``dmu``: Darwinian Model Upgrades (DMU Eq.8; docs/methods.md, Training objectives):
``L_new + L_SBC + L_FA``.

- ``L_new`` (DMU Eq.3) is the loop's classification loss on the new head ``w_n``: DMU uses
  ArcFace (s=30, m=0.3), so run with ``--head arcface`` (the head kind is a training option,
  not a method option).
- ``L_SBC = sum_x lambda(x) * ArcFace(w_o, phi_n(x)[:D_o])`` (Eq.10) through the frozen *old*
  classifier. The paper's Algorithm 1 feeds the new classifier's logits here; docs/methods.md
  calls that a bug and follows Eq.10, as does this module.
- ``lambda(x) = (1 - softmax_B(Lambda)) / (|B| - 1)`` (Eq.10), summing to 1 over the batch,
  where ``Lambda`` measures how *un*-discriminative the old feature is:
  ``entropy`` (Eq.9) of ``p = softmax(s * cos(w_o, phi_o(x)))``. The paper's Eq.9 has no
  scale s, which makes every entropy ~log C; s (``entropy_scale``) is configurable, default
  the ArcFace s. ``least_confidence``: DMU's Eq.13 sets ``Lambda = p_y`` and weights by
  ``softmax(p_y)``. Here ``Lambda = 1 - p_y`` (the least-confidence uncertainty) goes through
  the same Eq.10 weighting, so confident samples get the larger weight in both variants and
  the weights still sum to 1.
  ``B`` is the *global* batch (Lambda is gathered from every worker, no gradient needed), and
  only samples whose class the old classifier knows take part (an unknown class has no row in
  ``w_o``); with one such sample its weight is 1.
- ``L_FA = ArcFace(w_n, psi(phi_o(x)))`` (Eq.11): psi (3 x [Linear-BN-ReLU] + Linear, hidden
  1024) maps the detached old feature into the new space; trained jointly with ``phi_n`` and
  exported as ``psi`` for the gallery-side forward adaptation.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raycompat.config import ConfigError, choices, nonnegative, positive
from raycompat.methods.base import CompatMethod, TrainBatch, register_method
from raycompat.methods.gathered import gather, local_share, local_slice
from raycompat.models import PsiMLP, margin_logits


def discriminativeness(
    cos_old: torch.Tensor, old_rows: torch.Tensor, kind: str, scale: float
) -> torch.Tensor:
    """``Lambda(x)`` from the old classifier's cosines ``cos(w_o, phi_o(x))`` [B, C_o]:
    the entropy of ``softmax(scale * cos)`` (DMU Eq.9) or ``1 - p_y`` (least confidence)."""
    log_p = F.log_softmax(scale * cos_old, dim=1)
    if kind == "entropy":
        return -(log_p.exp() * log_p).sum(dim=1)
    return 1.0 - log_p.gather(1, old_rows.clamp(min=0)[:, None]).squeeze(1).exp()


def selective_weights(uncertainty: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """DMU Eq.10 batch weights ``(1 - softmax_B(Lambda)) / (|B| - 1)`` over the ``known``
    samples (0 for the others); they sum to 1 (a lone known sample gets 1)."""
    n = int(known.sum())
    weights = torch.zeros_like(uncertainty)
    if n == 1:
        weights[known] = 1.0
    elif n > 1:
        weights[known] = (1.0 - F.softmax(uncertainty[known], dim=0)) / (n - 1)
    return weights


@register_method
class DMU(CompatMethod):
    name = "dmu"
    description = (
        "Darwinian model upgrades: selective backward compatibility + forward-adaptive "
        "psi (exported as 'psi'); use --head arcface"
    )

    @dataclass
    class Options:
        lambda_compat: float = nonnegative(1.0)
        discriminativeness: str = choices("entropy", "least_confidence", default="entropy")
        entropy_scale: float = positive(30.0)
        arc_scale: float = positive(30.0)
        arc_margin: float = nonnegative(0.3)
        psi_hidden: int = positive(1024)

    @classmethod
    def check_config(cls, cfg, old_manifest: dict | None) -> None:
        """DMU weights samples by the old classifier (DMU Eq.10): the old model needs a head."""
        if old_manifest is not None and "head" not in old_manifest.get("modules", {}):
            raise ConfigError(
                f"method 'dmu' needs the old model's classifier head (L_SBC, DMU Eq.10); the "
                f"old model {cfg.old_model!r} has none (an imported model): use bct "
                "(variant=sys), l2, contrastive or p2s"
            )

    def setup(self, embedder, head):
        if getattr(head, "kind", "arcface") != "arcface":
            warnings.warn(
                f"dmu: the new head is {head.kind!r}; DMU's L_new and L_FA use ArcFace "
                "(--head arcface)",
                stacklevel=2,
            )
        self.psi = PsiMLP(
            self.old.embed_dim, embedder.embed_dim, hidden_dim=self.options.psi_hidden
        )

    def exports(self):
        return {"psi": self.psi}

    def compat_loss(self, model, batch: TrainBatch, emb):
        opts = self.options
        old_head = self.old.head
        old = self.old_features(batch.x_old)
        rows = batch.old_targets
        known = rows >= 0
        with torch.no_grad():
            uncertainty = discriminativeness(
                old_head.cosine(old), rows, opts.discriminativeness, opts.entropy_scale
            )
            all_uncertainty, all_known = gather(uncertainty, known)
            weights = local_slice(selective_weights(all_uncertainty, all_known), len(rows))
        logits = margin_logits(
            old_head.cosine(self.compatible_part(emb)),
            torch.where(known, rows, -1),
            "arcface",
            opts.arc_scale,
            opts.arc_margin,
        )
        sbc = F.cross_entropy(logits, rows.clamp(min=0), reduction="none")
        fa = F.cross_entropy(model.head(self.psi(old), batch.new_targets), batch.new_targets)
        return {"sbc": local_share((weights * sbc).sum()), "fa": fa}
