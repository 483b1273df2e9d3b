"""``l2``: BCT's naive baseline, ``L_compat = 0.5 * ||phi_n(x) - phi_o(x)||^2`` (BCT Eq.3;
docs/methods.md, Training objectives), on the raw (unnormalised) embeddings, summed over
dimensions, batch mean.

It needs ``D_new == D_old``; BCT shows it fails (new-to-old search below old-to-old).
"""

from __future__ import annotations

from raycompat.config import ConfigError
from raycompat.methods.base import CompatMethod, register_method


@register_method
class L2(CompatMethod):
    name = "l2"
    description = "BCT Eq.3 baseline: 0.5*||phi_n(x) - phi_o(x)||^2 (needs equal embedding dims)"

    @classmethod
    def check_config(cls, cfg, old_manifest):
        if old_manifest is not None and int(old_manifest["embed_dim"]) != cfg.embed_dim:
            raise ConfigError(
                f"method 'l2' needs embed_dim == the old model's "
                f"({old_manifest['embed_dim']}), got {cfg.embed_dim}"
            )

    def setup(self, embedder, head):
        if embedder.embed_dim != self.old.embed_dim:
            raise ConfigError(
                f"method 'l2' needs embed_dim == the old model's ({self.old.embed_dim}), "
                f"got {embedder.embed_dim}"
            )

    def compat_loss(self, model, batch, emb):
        diff = emb - self.old_features(batch.x_old)
        return {"l2": 0.5 * diff.pow(2).sum(dim=1).mean()}
