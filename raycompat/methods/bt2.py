"""``bt2``: backward-compatible training with basis transformation (Zhou, Li, Shrivastava, Zhao,
Torralba, Tian, Lim, "BT^2: Backward-compatible Training with Basis Transformation", ICCV 2023;
docs/methods.md, Field methods).

The backbone emits ``z`` of ``D_n + D_o`` dims (this method widens the embedder's last linear
layer) and ``raycompat.models.basis.BasisTransform`` gives ``v`` (``D_n``), the compatible part
``b`` (``D_o``) and the extra dims ``e``; the bundle's embedder is the deployed
``concat(b, e)`` (``D_n + A`` dims, ``compatible_dim = D_o``). With ``^`` = L2-normalised:

``L = CE(w_n(v), y) + lambda * [lambda_2 CE(b^ P^T, y) + lambda_3 (1 - mean <phi_o^(x), b^>)
+ lambda_1 (1 - mean <phi'_n^(x), v>)]``

- ``w_n`` is the run's head (``--head``) on ``v``; the released code's plain linear head on ``v``
  is ``--head softmax``;
- ``P``: the pseudo-classifier, the class means of ``phi_o^(x)`` over the new training set (every
  class; computed once, frozen; the old head is not used). The released code averages its old
  model's output features, which its ResNet normalises (``norm_feature=True``), so its rows are
  means of unit vectors; option ``pseudo_features=raw`` averages the raw ``phi_o(x)`` instead. Our
  embedders' raw features are unnormalised (norm ~190 for the reproduction's old model), which
  made ``b^ P^T`` logits of that size and collapsed the training (docs/methods.md, Field methods);
- ``phi'_n``: a separately trained independent new model (``independent_model``, a bundle of
  ``D_n`` dims), frozen. Without one ``lambda_1 = 0``: a deviation from the paper's two-stage
  training, warned about when the run is configured.

Defaults (the released configs): lambda_1 = 1, lambda_2 = 10, lambda_3 = 5, A = 32, C = 2. The
new model's view ``x_new`` feeds ``phi_n`` and ``phi'_n``, the old view ``x_old`` feeds ``phi_o``.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raycompat.config import ConfigError, choices, nonnegative, parse_options, positive
from raycompat.methods.base import CompatMethod, TrainBatch, register_method
from raycompat.methods.prototypes import class_prototypes
from raycompat.models import BasisEmbedder, BasisTransform, ModelBundle
from raycompat.models.basis import check_basis_dims


def _bundle_manifest(path: str, what: str) -> dict:
    """The manifest of the bundle at ``path`` (a local folder or a storage URI)."""
    from raycompat.storage import is_uri, local_copy

    try:
        folder = local_copy(path) if is_uri(path) else path
    except FileNotFoundError as exc:
        raise ConfigError(f"{what} {path!r}: {exc}") from exc
    manifest = os.path.join(folder, "manifest.json")
    if not os.path.isfile(manifest):
        raise ConfigError(f"{what} {path!r} is not a model bundle (no manifest.json there)")
    with open(manifest) as f:
        return json.load(f)


@register_method
class BT2(CompatMethod):
    name = "bt2"
    description = (
        "BT^2: basis transformation, D_n + A dims whose first D_o are compatible; "
        "--opt independent_model=PATH (the independent new model)"
    )

    @dataclass
    class Options:
        lambda_compat: float = nonnegative(1.0)
        lambda_1: float = nonnegative(1.0)  # independent new model, cosine on v
        lambda_2: float = nonnegative(10.0)  # pseudo-classifier CE on b
        lambda_3: float = nonnegative(5.0)  # old model, cosine on b
        extra_dim: int = positive(32)  # A
        scale: float = positive(2.0)  # C
        pseudo_features: str = choices("normalized", "raw", default="normalized")  # P's rows
        independent_model: str | None = None

    @classmethod
    def check_config(cls, cfg, old_manifest: dict | None) -> None:
        """Dimensions (``A <= D_o``, ``D_n + A >= D_o``) and the independent model: an absolute
        path or a URI (workers run in other folders) to a bundle of ``D_n`` dims, read when the
        old model's manifest is (``old_manifest`` given); none: a warning, ``lambda_1 = 0``."""
        from raycompat.storage import is_uri

        opts = parse_options(cls.Options, cfg.method_options, owner="method bt2")
        if old_manifest is not None:
            d_o = int(old_manifest["embed_dim"])
            try:
                check_basis_dims(cfg.embed_dim, d_o, opts.extra_dim)
            except ValueError as exc:
                raise ConfigError(f"{exc} (old model {cfg.old_model!r})") from exc
        path = opts.independent_model
        if path is None:
            warnings.warn(
                "bt2 without independent_model: lambda_1 = 0 (no independent new model to "
                "stay close to; BT^2 trains one first)",
                stacklevel=2,
            )
            return
        if not (os.path.isabs(path) or is_uri(path)):
            raise ConfigError(
                f"method bt2: independent_model {path!r} must be an absolute path or a URI "
                f"(Ray workers run in other folders): {os.path.abspath(path)!r}?"
            )
        if old_manifest is not None:
            manifest = _bundle_manifest(path, "independent_model")
            dim = manifest.get("embed_dim")
            if dim is not None and int(dim) != cfg.embed_dim:
                raise ConfigError(
                    f"method bt2: independent_model {path!r} embeds {dim} dims, but v has "
                    f"embed_dim {cfg.embed_dim} (D_n): they must match"
                )

    def __init__(self, options, context):
        super().__init__(options, context)
        path = options.independent_model
        independent = ModelBundle.load(path, context.device).freeze() if path else None
        # not a submodule: frozen, outside DDP and the checkpoints (as the old model)
        self.__dict__["independent"] = independent
        # from the frozen old model: not in checkpoints, recomputed at the first epoch start
        shape = (len(context.new_classes), context.compatible_dim)
        self.register_buffer("pseudo_classifier", torch.zeros(shape), persistent=False)
        self._ready = False

    def setup(self, embedder, head):
        """The embedder's last linear layer emits ``z`` (``D_n + D_o``); the basis transform."""
        new_dim, old_dim = embedder.embed_dim, self.context.compatible_dim
        self.basis = BasisTransform(new_dim, old_dim, self.options.extra_dim, self.options.scale)
        embedder.fc = nn.Linear(embedder.fc.in_features, new_dim + old_dim)
        embedder.embed_dim = new_dim + old_dim
        if hasattr(embedder, "spec"):
            embedder.spec = dict(embedder.spec, embed_dim=new_dim + old_dim)

    def deployed_embedder(self, embedder):
        return BasisEmbedder(embedder, self.basis)

    def on_epoch_start(self, epoch, model):
        """``P``: per class of the new training set, the mean ``phi_o^(x)`` (or raw ``phi_o(x)``,
        ``pseudo_features=raw``); once."""
        if self._ready:
            return
        old = self.old.embedder
        unit = self.options.pseudo_features == "normalized"

        def features(batch):
            f = old(batch.x_old)
            return F.normalize(f, dim=1) if unit else f

        means, _ = class_prototypes(
            self.context,
            len(self.context.new_classes),
            {"old": (features, self.old.embed_dim)},
            modules=(old,),
        )
        self.pseudo_classifier.copy_(means["old"])
        self._ready = True

    def compute_loss(self, model, batch: TrainBatch) -> dict[str, torch.Tensor]:
        opts, targets = self.options, batch.new_targets
        parts = self.basis.parts(model.embedder(batch.x_new))
        v, b = parts["v"], F.normalize(parts["b"], dim=1)
        terms = {"cls": F.cross_entropy(model.head(v, targets), targets)}
        old = F.normalize(self.old_features(batch.x_old), dim=1)
        compat = {
            "pseudo_cls": opts.lambda_2 * F.cross_entropy(b @ self.pseudo_classifier.t(), targets),
            "old_cosine": opts.lambda_3 * (1.0 - (old * b).sum(dim=1).mean()),
        }
        if self.independent is not None:
            with torch.no_grad():
                ind = F.normalize(self.independent.embedder(batch.x_new), dim=1)
            compat["new_cosine"] = opts.lambda_1 * (1.0 - (ind * v).sum(dim=1).mean())
        terms.update(compat)
        terms["loss"] = terms["cls"] + opts.lambda_compat * sum(compat.values())
        return terms
