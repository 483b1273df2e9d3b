"""Models: timm embedder with GeM, classifier heads, projection MLPs, BT^2's basis transform,
bundles on disk, and imported models (a timm checkpoint or a TorchScript file the user already
has)."""

from raycompat.models.basis import BasisEmbedder, BasisTransform
from raycompat.models.bundle import ModelBundle, build_module
from raycompat.models.embedder import Embedder, GeM
from raycompat.models.heads import ClassifierHead, margin_logits
from raycompat.models.imported import TimmFeatures, TorchScriptEmbedder
from raycompat.models.psi import FeatureMap, ForwardTransformation, ProjectionMLP, PsiMLP

__all__ = [
    "ModelBundle",
    "build_module",
    "Embedder",
    "GeM",
    "ClassifierHead",
    "margin_logits",
    "ProjectionMLP",
    "PsiMLP",
    "ForwardTransformation",
    "BasisEmbedder",
    "BasisTransform",
    "FeatureMap",
    "TimmFeatures",
    "TorchScriptEmbedder",
]
