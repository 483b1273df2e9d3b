"""``rqt``: reverse query transform only (RM Eq.9; docs/methods.md, Training objectives, a
baseline of ``mcl``): ``L = d(psi_rev(phi_n(x)), phi_o(x))``, batch mean, with
``phi_o``/``phi_n`` frozen and ``rho`` the identity (see ``rank_merge``)."""

from __future__ import annotations

from raycompat.methods.base import register_method
from raycompat.methods.rank_merge import RankMergeMethod, paired_distance


@register_method
class RQT(RankMergeMethod):
    name = "rqt"
    description = (
        "RM baseline: reverse query transform psi_rev trained with d(psi_rev(phi_n(x)), phi_o(x))"
    )

    def rank_merge_loss(self, new, rev, old, labels):
        return {"rqt": paired_distance(rev, old, self.options.distance).mean()}
