"""``dmu``: Darwinian Model Upgrades (DMU Eq.8; docs/methods.md, Training objectives):
``L_new + L_SBC + L_FA``.

- ``L_new`` (DMU Eq.3) is the loop's classification loss on the new head ``w_n``: DMU uses
  ArcFace (s=30, m=0.3), so run with ``--head arcface`` (the head kind is a training option,
  not a method option).
- ``L_SBC = sum_x lambda(x) * ArcFace(w_o, phi_n(x)[:D_o])`` (Eq.10) through the frozen *old*
  classifier. The paper's Algorithm 1 feeds the new classifier's logits here; docs/methods.md
  calls that a bug and follows Eq.10, as does this module.
- ``lambda(x) = (1 - softmax_B(Lambda)) / (|B| - 1)`` (Eq.12 entropy form), summing to 1
  over the batch, where ``Lambda`` is the entropy (Eq.9) of
  ``p = softmax(s * cos(w_o, phi_o(x)))``: how *un*-discriminative the old feature is. The
  paper's Eq.9 has no scale s, which makes every entropy ~log C; s (``entropy_scale``) is
  configurable, default the ArcFace s.
- ``least_confidence`` (Eq.13): ``Lambda = p_y``, the old classifier's probability of the true
  class, and ``lambda(x) = softmax_B(Lambda)`` directly (confident samples weigh more).
- Classes the old classifier lacks (open-class, extended-class) get synthesised rows appended
  to ``w_o``: the class mean of ``phi_o(x)`` over the new training set, as BCT-sys
  (``prototypes.synthesised_rows``, computed once). The extended classifier serves both
  ``Lambda`` and ``L_SBC``, so every sample takes part; without it an open-class DMU would
  have no compatibility loss at all.
- ``B`` is the *global* batch (Lambda is gathered from every worker, no gradient needed).
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
from raycompat.methods.prototypes import synthesised_rows, unknown_class_rows
from raycompat.models import PsiMLP, margin_logits


def discriminativeness(
    cos_old: torch.Tensor, old_rows: torch.Tensor, kind: str, scale: float
) -> torch.Tensor:
    """``Lambda(x)`` from the old classifier's cosines ``cos(w_o, phi_o(x))`` [B, C_o]: the
    entropy of ``softmax(scale * cos)`` (DMU Eq.9), or ``p_y`` of the true class (Eq.13)."""
    log_p = F.log_softmax(scale * cos_old, dim=1)
    if kind == "entropy":
        return -(log_p.exp() * log_p).sum(dim=1)
    return log_p.gather(1, old_rows.clamp(min=0)[:, None]).squeeze(1).exp()


def selective_weights(
    uncertainty: torch.Tensor, known: torch.Tensor, kind: str = "entropy"
) -> torch.Tensor:
    """DMU batch weights over the ``known`` samples (0 for the others), summing to 1:
    ``(1 - softmax_B(Lambda)) / (|B| - 1)`` for the entropy (Eq.12), ``softmax_B(Lambda)`` for
    least confidence (Eq.13, ``Lambda = p_y``); a lone known sample gets 1."""
    n = int(known.sum())
    weights = torch.zeros_like(uncertainty)
    if n == 1:
        weights[known] = 1.0
    elif n > 1 and kind == "least_confidence":
        weights[known] = F.softmax(uncertainty[known], dim=0)
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

    def __init__(self, options, context):
        super().__init__(options, context)
        mapping, synth, n_unseen = unknown_class_rows(context)
        self.register_buffer("old_row_of_new_target", mapping, persistent=False)
        self.register_buffer("synth_row_of_new_target", synth, persistent=False)
        # not in checkpoints (recomputed at the first epoch start, also after a resume)
        self.register_buffer(
            "synth_rows", torch.zeros(n_unseen, self.old.embed_dim), persistent=False
        )
        self._synthesised = False

    def on_epoch_start(self, epoch, model):
        """The synthesised old-classifier rows depend on the frozen old model only: once."""
        if self.synth_rows.shape[0] == 0 or self._synthesised:
            return
        rows = synthesised_rows(
            self.context, self.synth_row_of_new_target, self.synth_rows.shape[0], "dmu"
        )
        self.synth_rows.copy_(rows)
        self._synthesised = True

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

    def extended_rows(self, new_targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows of [w_o; synthesised], weight)``: every target's row in the old classifier
        extended with the synthesised rows (``-1`` only before they exist)."""
        old_rows = self.old_row_of_new_target[new_targets]
        synth = self.synth_row_of_new_target[new_targets] if self._synthesised else -1
        rows = torch.where(old_rows >= 0, old_rows, synth)
        weight = self.old.head.weight
        if self._synthesised:
            weight = torch.cat([weight, self.synth_rows], dim=0)
        return rows, weight

    def compat_loss(self, model, batch: TrainBatch, emb):
        opts = self.options
        old_head = self.old.head
        old = self.old_features(batch.x_old)
        rows, weight = self.extended_rows(batch.new_targets)
        known = rows >= 0
        with torch.no_grad():
            uncertainty = discriminativeness(
                old_head.cosine(old, weight), rows, opts.discriminativeness, opts.entropy_scale
            )
            all_uncertainty, all_known = gather(uncertainty, known)
            all_weights = selective_weights(all_uncertainty, all_known, opts.discriminativeness)
            weights = local_slice(all_weights, len(rows))
        logits = margin_logits(
            old_head.cosine(self.compatible_part(emb), weight),
            torch.where(known, rows, -1),
            "arcface",
            opts.arc_scale,
            opts.arc_margin,
        )
        sbc = F.cross_entropy(logits, rows.clamp(min=0), reduction="none")
        fa = F.cross_entropy(model.head(self.psi(old), batch.new_targets), batch.new_targets)
        return {"sbc": local_share((weights * sbc).sum()), "fa": fa}
