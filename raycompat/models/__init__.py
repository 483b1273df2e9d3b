"""Models: timm embedder with GeM, classifier heads, projection MLPs, BT^2's basis transform,
bundles on disk, and imported models (a timm checkpoint or a TorchScript file the user already
has)."""

import importlib

_EXPORTS = {
    "BasisEmbedder": "basis",
    "BasisTransform": "basis",
    "ModelBundle": "bundle",
    "build_module": "bundle",
    "Embedder": "embedder",
    "GeM": "embedder",
    "ClassifierHead": "heads",
    "margin_logits": "heads",
    "TimmFeatures": "imported",
    "TorchScriptEmbedder": "imported",
    "FeatureMap": "psi",
    "ForwardTransformation": "psi",
    "ProjectionMLP": "psi",
    "PsiMLP": "psi",
}


def __getattr__(name):
    """Lazy exports: a process that only reads a model's plain parts (the uncertainty head's
    arrays, a bundle's fingerprint) does not import torch (seconds per process)."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
