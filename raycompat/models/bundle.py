"""Save and load trained models as a folder: one ``<name>.pt`` state_dict per module plus a
JSON manifest (method, backbone names, dims, classes, data scenario, versions). A module may
also write files of its own into the folder (``save_files``: a TorchScript embedder's file).

Every module carries a ``spec`` dict (its constructor arguments), so a bundle rebuilds
itself from the manifest alone. Weights are loaded with ``weights_only=True``: nothing is
unpickled beyond tensors.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from raycompat.config import ConfigError
from raycompat.models.basis import BasisEmbedder, BasisTransform
from raycompat.models.embedder import Embedder
from raycompat.models.heads import ClassifierHead
from raycompat.models.imported import (
    ImportedModel,
    TimmFeatures,
    TorchScriptEmbedder,
    file_sha256,
)
from raycompat.models.psi import ForwardTransformation, ProjectionMLP

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def _torchscript(kwargs: dict[str, Any], root: str | None) -> nn.Module:
    if root is None:
        raise ValueError("a 'torchscript' module is rebuilt from its bundle folder (root)")
    return TorchScriptEmbedder.load(os.path.join(root, kwargs.pop("file")), **kwargs)


def _bt2(kwargs: dict[str, Any], root: str | None) -> nn.Module:
    """BT^2's deployed embedder: its backbone embedder's spec, then the basis transform."""
    return BasisEmbedder(build_module(kwargs["base"], root), BasisTransform(**kwargs["basis"]))


#: module type (``spec["type"]``) -> builder ``(constructor arguments, bundle folder)``
MODULE_TYPES: dict[str, Callable[[dict[str, Any], str | None], nn.Module]] = {
    "embedder": lambda kwargs, root: Embedder(**kwargs),
    "head": lambda kwargs, root: ClassifierHead(**kwargs),
    "mlp": lambda kwargs, root: ProjectionMLP(**kwargs),
    "fct": lambda kwargs, root: ForwardTransformation(**kwargs),
    "bt2": _bt2,
    "timm": lambda kwargs, root: TimmFeatures(**kwargs),
    "torchscript": _torchscript,
}


def build_module(spec: dict[str, Any], root: str | None = None) -> nn.Module:
    """Rebuild a module from its ``spec`` (the inverse of ``module.spec``) by its registered type
    (``MODULE_TYPES``); ``root``: the bundle folder, for modules kept in a file of their own
    there (``torchscript``)."""
    kwargs = {k: v for k, v in spec.items() if k != "type"}
    kind = spec.get("type")
    if kind not in MODULE_TYPES:
        raise ValueError(
            f"unknown module type {kind!r} in manifest; allowed: {', '.join(MODULE_TYPES)}"
        )
    return MODULE_TYPES[kind](kwargs, root)


def _versions() -> dict[str, str]:
    import timm

    import raycompat

    return {
        "raycompat": raycompat.__version__,
        "torch": torch.__version__,
        "timm": timm.__version__,
    }


@dataclass
class ModelBundle:
    """A trained model: named modules (``embedder``, ``head``, and e.g. ``psi``) + manifest.

    ``manifest['classes']`` lists the catalog class index of every head row, so labels from
    any split map onto head rows; ``manifest['compatible_dim']`` is the number of leading
    embedding dims that are compatible with the predecessor (BCT dimension change).
    """

    modules: dict[str, nn.Module]
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def embedder(self) -> Embedder:
        return self.modules["embedder"]

    @property
    def has_head(self) -> bool:
        """Whether the bundle has a classifier head (an imported model has none)."""
        return "head" in self.modules

    @property
    def head(self) -> ClassifierHead:
        if not self.has_head:
            raise ConfigError(
                f"the model bundle (method {self.manifest.get('method')!r}) has no classifier "
                f"head; it has {sorted(self.modules)}"
            )
        return self.modules["head"]

    @property
    def embed_dim(self) -> int:
        return self.embedder.embed_dim

    @property
    def classes(self) -> list[int]:
        return list(self.manifest.get("classes", []))

    def eval(self) -> ModelBundle:
        for module in self.modules.values():
            module.eval()
        return self

    def to(self, device) -> ModelBundle:
        for module in self.modules.values():
            module.to(device)
        return self

    def freeze(self) -> ModelBundle:
        self.eval()
        for module in self.modules.values():
            module.requires_grad_(False)
        return self

    def save(self, path: str) -> str:
        """Write atomically: a temporary sibling folder renamed into place."""
        parent = os.path.dirname(os.path.abspath(path)) or "."
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".bundle-", dir=parent)
        manifest = dict(self.manifest)
        manifest["format_version"] = FORMAT_VERSION
        manifest["modules"] = {name: m.spec for name, m in self.modules.items()}
        manifest.setdefault("versions", _versions())
        for name, module in self.modules.items():
            torch.save(module.state_dict(), os.path.join(tmp, f"{name}.pt"))
            if hasattr(module, "save_files"):  # e.g. a TorchScript embedder's own file
                module.save_files(tmp)
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
        self.manifest = manifest
        return path

    @classmethod
    def load(cls, path: str, device: str | torch.device = "cpu") -> ModelBundle:
        """Load a bundle folder: a local path, or a storage URI (downloaded first)."""
        from raycompat.storage import is_uri, local_copy

        if is_uri(path):
            path = local_copy(path)
        manifest_path = os.path.join(path, MANIFEST)
        if not os.path.isfile(manifest_path):
            raise FileNotFoundError(f"no model bundle at {path!r}: {MANIFEST} is missing")
        with open(manifest_path) as f:
            manifest = json.load(f)
        modules: dict[str, nn.Module] = {}
        for name, spec in manifest.get("modules", {}).items():
            module = build_module(spec, root=path)
            state = torch.load(
                os.path.join(path, f"{name}.pt"), map_location=device, weights_only=True
            )
            module.load_state_dict(state)
            modules[name] = module.to(device).eval()
        return cls(modules, manifest)


def imported_bundle(model: ImportedModel, resolution: int) -> ModelBundle:
    """A head-less :class:`ModelBundle` of an imported ``model``: ``classes`` is empty,
    ``compatible_dim`` is its own embedding size, generation 0."""
    spec = model.embedder.spec
    manifest = {
        "method": "imported",
        "backbone": model.backbone,
        "embed_dim": int(spec["embed_dim"]),
        "in_chans": int(spec["in_chans"]),
        "resolution": int(resolution),
        "classes": [],
        "compatible_dim": int(spec["embed_dim"]),
        "predecessor": None,
        "generation": 0,
        "imported": {
            "form": model.form,
            "source": os.path.abspath(model.source),
            "sha256": file_sha256(model.source),
            "input_norm": spec.get("input_norm", "none"),
        },
    }
    return ModelBundle({"embedder": model.embedder}, manifest)
