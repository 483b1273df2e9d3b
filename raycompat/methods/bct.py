"""``bct``: Backward-Compatible Training, influence loss (BCT Eq.8; docs/methods.md, Training
objectives).

``L_compat = CE(w_o(phi_n(x)[:D_o]), y)`` through the frozen old classifier, with three
ways to treat samples whose class the old head does not know:

- ``beta``: drop them (the mean runs over the known samples of the global batch);
- ``sys`` (default): append synthesised rows to ``w_o``, the class mean of ``phi_o(x)``
  over the new training set (computed distributed by ``prototypes.class_mean_features``,
  once, from the frozen old model, so the same whatever the number of workers);
- ``kd``: ``KL(softmax(s*w_o(phi_o(x))) || softmax(s*w_o(phi_n(x))))``, s=32, for them.

An old model without a classifier (imported with ``raycompat import-model``) has no ``w_o``:
only ``sys`` applies, every row is synthesised, and the rows are scored as a CosFace head
(s=32, m=0.4, BCT's face setting; ``HEAD_DEFAULTS['cosface']``).

Dimension change: only the first ``D_o`` dims of the new embedding meet the old classifier
(``compatible_part``); the same subspace is used in cross-model search.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raycompat.config import ConfigError, choices, nonnegative, parse_options, positive
from raycompat.methods.base import CompatMethod, TrainBatch, register_method
from raycompat.methods.gathered import global_mean
from raycompat.methods.prototypes import (
    class_mean_features,
    synthesised_rows,
    unknown_class_rows,
)
from raycompat.models.heads import HEAD_DEFAULTS, margin_logits

__all__ = ["BCT", "class_mean_features"]


@register_method
class BCT(CompatMethod):
    name = "bct"
    description = "backward-compatible training: influence loss through the frozen old classifier"

    @dataclass
    class Options:
        variant: str = choices("sys", "beta", "kd", default="sys")
        lambda_compat: float = nonnegative(1.0)
        kd_scale: float = positive(32.0)

    @classmethod
    def check_config(cls, cfg, old_manifest):
        """A head-less old model (imported) allows only the ``sys`` variant."""
        if old_manifest is None or "head" in old_manifest.get("modules", {}):
            return
        variant = parse_options(cls.Options, cfg.method_options, owner="method bct").variant
        check_headless_variant(variant, cfg.old_model)

    def __init__(self, options, context):
        super().__init__(options, context)
        if not self.old.has_head:
            source = self.old.manifest.get("imported", {}).get("source")
            check_headless_variant(options.variant, source)
        # new-head target -> old-head row (or -1: the "new classes"), and -> synthesised row
        mapping, synth, n_unseen = unknown_class_rows(context)
        self.register_buffer("old_row_of_new_target", mapping, persistent=False)
        self.register_buffer("synth_row_of_new_target", synth, persistent=False)
        self.register_buffer("synth_rows", torch.zeros(n_unseen, self.old.embed_dim))
        self._synthesised = False

    def on_epoch_start(self, epoch, model):
        """BCT-sys: the synthesised rows depend on the frozen old model only: computed once."""
        if self.options.variant != "sys" or self.synth_rows.shape[0] == 0 or self._synthesised:
            return
        rows = synthesised_rows(
            self.context, self.synth_row_of_new_target, self.synth_rows.shape[0], "bct-sys"
        )
        self.synth_rows.copy_(rows)
        self._synthesised = True

    def sys_logits(self, part: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logits of ``[w_o; synthesised rows]``; without an old head, the synthesised rows
        alone, as a CosFace head."""
        if not self.old.has_head:
            cos = F.linear(F.normalize(part, dim=-1), F.normalize(self.synth_rows, dim=-1))
            return margin_logits(cos, rows, "cosface", **HEAD_DEFAULTS["cosface"])
        old_head = self.old.head
        weight = torch.cat([old_head.weight, self.synth_rows], dim=0)
        return old_head(part, rows, weight=weight)

    def compat_loss(self, model, batch: TrainBatch, emb):
        part = self.compatible_part(emb)
        old_rows = self.old_row_of_new_target[batch.new_targets]
        known = old_rows >= 0
        variant = self.options.variant
        if variant == "sys":
            rows = torch.where(known, old_rows, self.synth_row_of_new_target[batch.new_targets])
            return {"influence": F.cross_entropy(self.sys_logits(part, rows), rows)}
        old_head = self.old.head
        # beta (and kd's known part): mean over the known samples of the global batch.
        safe_rows = old_rows.clamp(min=0)
        ce = F.cross_entropy(
            old_head(part, torch.where(known, old_rows, -1)), safe_rows, reduction="none"
        )
        terms = {"influence": global_mean(ce, known)}
        if variant == "kd":
            unknown = ~known
            s = self.options.kd_scale
            teacher = F.softmax(s * old_head.cosine(self.old_features(batch.x_old)), dim=1)
            student = F.log_softmax(s * old_head.cosine(part), dim=1)
            kl = F.kl_div(student, teacher, reduction="none").sum(dim=1)
            # A batch mean in which known samples count as 0.
            terms["kd"] = torch.where(unknown, kl, torch.zeros_like(kl)).mean()
        return terms


def check_headless_variant(variant: str, old_model: str | None) -> None:
    """Without an old classifier, ``beta`` and ``kd`` have nothing to train against."""
    if variant != "sys":
        raise ConfigError(
            f"method bct variant {variant!r} needs the old model's classifier head, and the "
            f"old model {old_model!r} has none (an imported model); use variant=sys "
            "(synthesised classifier rows from class means of old features) or a method "
            "that needs no old head (l2, contrastive, p2s)"
        )
