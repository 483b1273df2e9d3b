"""``fct``: forward compatible training (Ramanujan, Vasu, Farhadi, Tuzel, Pouransari, "Forward
Compatible Training for Large-Scale Embedding Retrieval Systems", CVPR 2022; docs/methods.md,
Field methods).

``phi_n`` is an independently trained new model (``--init-model``, frozen with its head) and
``phi_o`` the old one (frozen); only the transformation ``h`` (``ForwardTransformation``:
``D_o -> 2 D_o -> 2 D_n``, then ``2 D_n -> H -> H -> D_n``, H = 2048) trains:

``L = MSE(h(phi_o(x)), phi_n(x))``, raw (unnormalised) features, mean over samples and dims.

Both models see the same view of an image (view 0), as the released trainer feeds one batch to
both. ``h`` is exported as ``fct``: the query mode ``fct`` scores old-state gallery items with
``s(phi_n(q), h(phi_o(g)))``, no image needed (the gallery transform, like DMU's psi).

Choices: no side information. FCT's ``psi(x)`` is a SimCLR model trained on the new data, not
available here, and the gallery would have to store ``psi(x)`` beside ``phi_o(x)``; the released
configuration without the side-information line (what runs here) leaves ``p2`` out and the
mixer reads ``p1``'s ``2 D_n`` dims. ``batchnorm=switch`` (default), the released trainer's
``switch_mode_to_eval``: ``h`` trains in train mode (batch statistics, synchronized over
workers, updating the running ones) for the epochs ``e < E / 2`` and in eval mode from then on,
its BatchNorm layers frozen at the statistics the first half gathered and acting as learnable
affine maps. ``eval`` runs eval mode throughout (the initial statistics), ``train`` train mode
throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from raycompat.config import choices, positive
from raycompat.methods.base import CompatMethod, TrainBatch, register_method
from raycompat.models import ForwardTransformation


@register_method
class FCT(CompatMethod):
    name = "fct"
    description = (
        "forward compatible training: h(phi_o) -> phi_n by MSE on frozen models (exported as "
        "'fct', query mode fct); needs --init-model (the independent new model)"
    )
    trains_embedder = False
    needs_init_model = True

    @dataclass
    class Options:
        hidden: int = positive(2048)
        batchnorm: str = choices("switch", "eval", "train", default="switch")

    def setup(self, embedder, head):
        self.transformation = ForwardTransformation(
            self.old.embed_dim, embedder.embed_dim, hidden_dim=self.options.hidden
        )
        self.epoch = 0
        self.train(self.training)

    def on_epoch_start(self, epoch: int, model) -> None:
        self.epoch = epoch

    @property
    def batchnorm_in_eval(self) -> bool:
        """``h``'s BatchNorm layers run on their stored statistics while training: always
        (``eval``), never (``train``), or from epoch ``E / 2`` on (``switch``, the released
        ``epoch >= epochs / 2``)."""
        if self.options.batchnorm == "switch":
            return self.epoch >= self.context.epochs / 2
        return self.options.batchnorm == "eval"

    def train(self, mode: bool = True):
        super().train(mode)
        if self.batchnorm_in_eval:
            self.transformation.eval()
        return self

    def exports(self):
        return {"fct": self.transformation}

    def compute_loss(self, model, batch: TrainBatch) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            target = model.embedder(batch.x_new)
            old = self.old.embedder(batch.x_new)
        loss = F.mse_loss(self.transformation(old), target)
        return {"fct": loss, "loss": loss}
