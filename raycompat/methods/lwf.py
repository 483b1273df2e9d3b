"""``lwf``: Learning without Forgetting as a compatibility baseline (Li & Hoiem, "Learning without
Forgetting", ECCV 2016 / TPAMI 2017; the OpenCompatible baseline; docs/methods.md, Field methods).

The frozen old head ``w_o`` scores both the old and the new features, and the new feature learns
the old feature's distribution over the old classes, on every sample (no label used):

``L_lwf = -mean_i sum_k p_o[i, k] * log softmax(s * cos(w_o, phi_n(x_i)[:D_o]))[k]``,
``p_o = softmax(s_t * cos(w_o, phi_o(x_i)))``

Choice: the released code applies ``w_o`` to raw features with temperatures 0.01, which makes
the teacher one-hot and depends on ``w_o``'s row norms; here both sides are cosine logits times a
scale (s = s_t = 30, i.e. a temperature of 1/30 on cosines, the recommended form), the same
logits BCT-kd distils. Any old head kind works: ``cosine`` ignores a softmax head's bias.
Dimension change: ``phi_n(x)[:D_o]`` meets ``w_o`` (BCT's compatible subspace).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from raycompat.config import ConfigError, nonnegative, positive
from raycompat.methods.base import CompatMethod, TrainBatch, register_method


def check_old_head(method: str, cfg, old_manifest: dict | None, why: str) -> None:
    """Methods that score through ``w_o``: an imported (head-less) old model is refused."""
    if old_manifest is not None and "head" not in old_manifest.get("modules", {}):
        raise ConfigError(
            f"method {method!r} needs the old model's classifier head ({why}); the old model "
            f"{cfg.old_model!r} has none (an imported model)"
        )


@register_method
class LwF(CompatMethod):
    name = "lwf"
    description = (
        "Learning without Forgetting baseline: distil the old head's outputs on phi_o into "
        "the old head's outputs on phi_n (needs the old head)"
    )

    @dataclass
    class Options:
        lambda_compat: float = nonnegative(1.0)
        scale: float = positive(30.0)  # s on the student's cosine logits (1 / temperature)
        teacher_scale: float = positive(30.0)  # s_t on the teacher's cosine logits

    @classmethod
    def check_config(cls, cfg, old_manifest):
        check_old_head("lwf", cfg, old_manifest, "it distils the old head's outputs")

    def __init__(self, options, context):
        super().__init__(options, context)
        if not self.old.has_head:
            raise ConfigError("method 'lwf' needs the old model's classifier head; it has none")

    def compat_loss(self, model, batch: TrainBatch, emb):
        head, opts = self.old.head, self.options
        teacher = F.softmax(opts.teacher_scale * head.cosine(self.old_features(batch.x_old)), dim=1)
        student = F.log_softmax(opts.scale * head.cosine(self.compatible_part(emb)), dim=1)
        return {"lwf": -(teacher * student).sum(dim=1).mean()}
