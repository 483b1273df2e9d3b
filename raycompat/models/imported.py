"""A model the user already has, as the embedder of a model bundle (docs/architecture.md,
"Model bundle"; the ``import-model`` job).

Two forms, nothing downloaded:

- a timm network (built with ``pretrained=False``) and a local checkpoint: either the
  ``state_dict`` of a raycompat :class:`~raycompat.models.Embedder` (keys ``backbone.*``,
  ``pool.p``, ``fc.*``), or of the plain timm model, whose pooled features are the embedding
  (its classifier, if any, is dropped) -> :class:`TimmFeatures`;
- a TorchScript file whose forward maps images to ``[B, embed_dim]`` ->
  :class:`TorchScriptEmbedder`, the file copied into the bundle.

Both take the pipeline's pixels (``[B, C, H, W]`` in [-1, 1]); ``input_norm`` converts them
to what the model was trained on: ``unit`` ([0, 1]) or ``imagenet`` ([0, 1], then the ImageNet
mean and std). An imported bundle has no classifier head (``manifest['classes'] == []``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raycompat.config import ConfigError

__all__ = [
    "INPUT_NORMS",
    "ImportedModel",
    "TimmFeatures",
    "TorchScriptEmbedder",
    "import_timm",
    "import_torchscript",
    "normalize_input",
    "read_state_dict",
]

#: ``input_norm`` choices: pixels in [-1, 1] as they come, in [0, 1], or ImageNet-normalised
INPUT_NORMS = ("none", "unit", "imagenet")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: the TorchScript file's name inside a bundle folder (".pt": in the bundle's fingerprint)
SCRIPT_FILE = "embedder.torchscript.pt"
#: keys under which training scripts commonly nest the state_dict
NESTED_KEYS = ("state_dict", "model", "model_state_dict")
#: prefixes added by DistributedDataParallel and torch.compile
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def normalize_input(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Pipeline pixels in [-1, 1] -> the input convention ``kind`` (see ``INPUT_NORMS``)."""
    if kind == "none":
        return x
    unit = (x + 1.0) * 0.5
    if kind == "unit":
        return unit
    mean = torch.tensor(IMAGENET_MEAN, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return (unit - mean) / std


def check_timm_name(name: str) -> None:
    """``name`` must be a timm model name; the error lists close names."""
    import difflib

    import timm

    names = timm.list_models()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=8)
        raise ConfigError(
            f"--timm {name!r} is not a timm model name"
            + (f"; similar names: {close}" if close else "")
        )


def check_input_norm(kind: str, in_chans: int) -> None:
    if kind not in INPUT_NORMS:
        raise ConfigError(f"input_norm {kind!r} is not allowed; allowed: {list(INPUT_NORMS)}")
    if kind == "imagenet" and in_chans != 3:
        raise ConfigError(f"input_norm 'imagenet' needs in_chans 3, got {in_chans}")


class TimmFeatures(nn.Module):
    """phi(x) = the pooled features of a plain timm model (``num_classes=0``)."""

    def __init__(self, backbone: str, embed_dim: int, in_chans: int = 3, input_norm: str = "none"):
        super().__init__()
        import timm

        check_input_norm(input_norm, in_chans)
        self.model = timm.create_model(backbone, pretrained=False, num_classes=0, in_chans=in_chans)
        self.embed_dim = int(embed_dim)
        self.input_norm = input_norm
        self.spec = dict(
            type="timm",
            backbone=backbone,
            embed_dim=int(embed_dim),
            in_chans=int(in_chans),
            input_norm=input_norm,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(normalize_input(x, self.input_norm))

    @torch.no_grad()
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """L2-normalised retrieval embedding."""
        return F.normalize(self.forward(x), dim=-1)


@contextlib.contextmanager
def quiet_jit() -> Iterator[None]:
    """Without torch's FutureWarning that TorchScript is deprecated: the user's file is one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=r".*torch\.jit")
        yield


def jit_load(path: str) -> torch.jit.ScriptModule:
    with quiet_jit():
        return torch.jit.load(path, map_location="cpu")


class TorchScriptEmbedder(nn.Module):
    """phi(x) = a TorchScript module; saved into the bundle folder as ``SCRIPT_FILE`` (its
    weights also go to ``embedder.pt``, like every module's)."""

    def __init__(
        self,
        model: torch.jit.ScriptModule,
        embed_dim: int,
        in_chans: int = 3,
        input_norm: str = "none",
    ):
        super().__init__()
        check_input_norm(input_norm, in_chans)
        self.model = model
        self.embed_dim = int(embed_dim)
        self.input_norm = input_norm
        self.spec = dict(
            type="torchscript",
            file=SCRIPT_FILE,
            embed_dim=int(embed_dim),
            in_chans=int(in_chans),
            input_norm=input_norm,
        )

    @classmethod
    def load(cls, path: str, **kwargs) -> TorchScriptEmbedder:
        """Rebuild from a TorchScript file (``kwargs``: the spec's other entries)."""
        return cls(jit_load(path), **kwargs)

    def save_files(self, folder: str) -> None:
        """Write the TorchScript file into the bundle folder (``ModelBundle.save``)."""
        with quiet_jit():
            torch.jit.save(self.model, os.path.join(folder, self.spec["file"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(normalize_input(x, self.input_norm))

    @torch.no_grad()
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """L2-normalised retrieval embedding."""
        return F.normalize(self.forward(x), dim=-1)


@dataclass(frozen=True)
class ImportedModel:
    """An imported embedder and where it came from (recorded in the manifest)."""

    embedder: nn.Module
    form: str  # "embedder" (a raycompat Embedder), "timm" or "torchscript"
    backbone: str
    source: str


def error_reason(exc: BaseException, last: bool = False) -> str:
    """The first sentence of an error's first (or, for TorchScript tracebacks, last) line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return (lines[-1] if last else lines[0]).split(". ")[0]


def _require_file(path: str, flag: str) -> str:
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path!r}: no such file")
    return path


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors: a state_dict, or one nested under ``state_dict`` / ``model`` /
    ``model_state_dict``; ``module.`` and ``_orig_mod.`` prefixes stripped. Only tensors are
    unpickled (``weights_only=True``)."""
    path = _require_file(path, "--checkpoint")
    try:
        with warnings.catch_warnings():  # torch warns before refusing a TorchScript archive
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        if "TorchScript" in str(exc):
            raise ConfigError(
                f"--checkpoint {path!r} is a TorchScript file: import it with --torchscript"
            ) from None
        raise ConfigError(
            f"--checkpoint {path!r} is not a weights-only torch checkpoint "
            f"({error_reason(exc)}); save model.state_dict() with torch.save"
        ) from None
    for key in NESTED_KEYS:
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not state:
        raise ConfigError(f"--checkpoint {path!r} holds no state_dict")
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ConfigError(
            f"--checkpoint {path!r} is not a state_dict: key {bad[0]!r} holds a "
            f"{type(state[bad[0]]).__name__}, not a tensor"
        )
    return {_strip_prefixes(k): v for k, v in state.items()}


def _strip_prefixes(key: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        while key.startswith(prefix):
            key = key[len(prefix) :]
    return key


def load_strict(module: nn.Module, state: dict[str, torch.Tensor], what: str, path: str) -> None:
    """``module.load_state_dict(state)``, or a ``ConfigError`` naming the missing, unexpected or
    wrongly shaped keys."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ConfigError(
            f"--checkpoint {path!r} does not fit {what}: "
            f"{len(missing)} missing keys {missing[:5]}, "
            f"{len(unexpected)} unexpected keys {unexpected[:5]}"
        )
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ConfigError(
                f"--checkpoint {path!r}: key {key!r} has shape {list(tensor.shape)}, "
                f"{what} expects {list(expected[key].shape)} (check --in-chans)"
            )
    module.load_state_dict(state, strict=True)


def classifier_keys(model: nn.Module, state: dict[str, torch.Tensor]) -> list[str]:
    """The checkpoint keys of a timm model's classifier (``pretrained_cfg['classifier']``)."""
    names = model.pretrained_cfg.get("classifier") or ()
    names = (names,) if isinstance(names, str) else tuple(names)
    return [k for k in state if any(k.startswith(n + ".") for n in names)]


def dummy_output(module: nn.Module, in_chans: int, resolution: int, what: str) -> torch.Tensor:
    """``module`` on a zero batch ``[2, in_chans, resolution, resolution]`` (eval mode), or a
    ``ConfigError`` naming ``what`` and the error's first line."""
    module.eval()
    x = torch.zeros(2, in_chans, resolution, resolution)
    try:
        with torch.no_grad():
            return module(x)
    except Exception as exc:  # the user's model: any failure is reported, not raised
        raise ConfigError(
            f"{what} fails on a [2, {in_chans}, {resolution}, {resolution}] input "
            f"(check --in-chans and --resolution): {error_reason(exc, last=True)}"
        ) from None


def check_embed_dim(out: object, embed_dim: int, what: str) -> None:
    """The dummy output must be a ``[2, embed_dim]`` tensor."""
    shape = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[1] != embed_dim:
        raise ConfigError(
            f"{what} gives output {shape} for a batch of 2, but --embed-dim {embed_dim} "
            f"needs [2, {embed_dim}]"
        )


def import_timm(
    backbone: str,
    checkpoint: str,
    embed_dim: int,
    in_chans: int = 3,
    resolution: int = 224,
    input_norm: str = "none",
) -> ImportedModel:
    """A timm model with the weights of ``checkpoint`` (a raycompat ``Embedder`` state_dict,
    or the plain timm model's, classifier dropped), checked to embed to ``embed_dim``."""
    from raycompat.models.embedder import Embedder

    check_timm_name(backbone)
    check_input_norm(input_norm, in_chans)
    state = read_state_dict(checkpoint)
    path = os.path.expanduser(checkpoint)
    if any(k.startswith("backbone.") for k in state):
        if input_norm != "none":
            raise ConfigError(
                "--input-norm applies to plain timm and TorchScript models; a raycompat "
                "Embedder checkpoint takes the pipeline's pixels as they are"
            )
        if "fc.weight" in state and state["fc.weight"].shape[0] != embed_dim:
            raise ConfigError(
                f"--embed-dim {embed_dim} does not match the checkpoint {path!r}: its "
                f"embedding size (fc.weight rows) is {state['fc.weight'].shape[0]}"
            )
        gem_p = float(state["pool.p"]) if "pool.p" in state else 3.0
        module = Embedder(backbone, embed_dim, in_chans=in_chans, gem_p=gem_p)
        load_strict(module, state, f"a raycompat Embedder({backbone!r})", path)
        form = "embedder"
    else:
        module = TimmFeatures(backbone, embed_dim, in_chans, input_norm)
        state = {k: v for k, v in state.items() if k not in classifier_keys(module.model, state)}
        load_strict(module.model, state, f"the timm model {backbone!r}", path)
        form = "timm"
    out = dummy_output(module, in_chans, resolution, f"timm model {backbone!r}")
    if form == "timm" and out.ndim == 2 and out.shape[1] != embed_dim:
        raise ConfigError(
            f"--embed-dim {embed_dim} does not match the checkpoint {path!r}: timm model "
            f"{backbone!r} gives {out.shape[1]}-dim features"
        )
    check_embed_dim(out, embed_dim, f"timm model {backbone!r}")
    return ImportedModel(module.eval(), form, backbone, path)


def import_torchscript(
    path: str,
    embed_dim: int,
    in_chans: int = 3,
    resolution: int = 224,
    input_norm: str = "none",
) -> ImportedModel:
    """A TorchScript embedder, checked by one forward pass to give ``[B, embed_dim]``."""
    path = _require_file(path, "--torchscript")
    check_input_norm(input_norm, in_chans)
    try:
        scripted = jit_load(path)
    except Exception as exc:  # not a TorchScript archive: the user's file, reported
        raise ConfigError(
            f"--torchscript {path!r} is not a TorchScript file: {error_reason(exc)}"
        ) from None
    module = TorchScriptEmbedder(scripted, embed_dim, in_chans, input_norm)
    out = dummy_output(module, in_chans, resolution, f"TorchScript model {path!r}")
    check_embed_dim(out, embed_dim, f"TorchScript model {path!r}")
    return ImportedModel(module.eval(), "torchscript", "torchscript", path)


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
