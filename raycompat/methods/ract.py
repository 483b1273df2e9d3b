"""``ract``: regression-alleviating compatible training (RACT Eq.6; docs/methods.md, Training
objectives).

``logits = [s(n_i,o_i) | s(n_i,o_k) for k | s(n_i,n_k) for k] / tau``, target column 0, every
``k`` with ``y_k == y_i`` (i included) masked out of both negative blocks, ``k`` over the
global batch gathered from every DDP worker (``gathered.compatibility_logits``). The
new-to-new block uses the whole new embedding; new-to-old the first ``D_o`` dims.
``form=triplet``: appendix Eq.15 with the corrected sign, ``mean_k [max(0, s(n_i,o_k) -
s(n_i,o_i) + m) + max(0, s(n_i,n_k) - s(n_i,o_i) + m)]``, m=0.8.
"""

from __future__ import annotations

from raycompat.methods.base import register_method
from raycompat.methods.contrastive import Contrastive


@register_method
class RACT(Contrastive):
    name = "ract"
    description = "regression-alleviating compatible training (RACT Eq.6): + new-to-new negatives"
    new_to_new = True
