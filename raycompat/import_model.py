"""Import a model you already have (a timm checkpoint or a TorchScript file) as a model bundle.

The bundle is an old model for BCT and the other methods, and an embedder for the pipeline;
nothing is downloaded. Two forms:

- ``raycompat import-model --timm resnet18 --checkpoint old.pth --embed-dim 512 --in-chans 3
  --resolution 224 --out models/old``: a timm network built with ``pretrained=False`` and the
  weights of ``old.pth`` (a state_dict, or a dict holding it under ``state_dict`` / ``model``;
  ``module.`` prefixes stripped), loaded strictly. The checkpoint is either a raycompat
  ``Embedder``'s or the plain timm model's, whose pooled features are the embedding (its
  classifier is dropped);
- ``raycompat import-model --torchscript old.pt --embed-dim 128 --in-chans 3 --resolution 64
  --out models/old``: a TorchScript file, copied into the bundle.

Either way one forward pass on a dummy batch checks that the output is ``[B, embed_dim]``, and
the saved bundle is loaded back and checked to give the same embeddings. ``--input-norm``
states what the model expects: the pipeline's pixels in [-1, 1] (``none``), [0, 1] (``unit``)
or ImageNet-normalised (``imagenet``). The bundle has no classifier head: ``bct`` trains
against it with synthesised classifier rows (``variant=sys``, the default). See
docs/architecture.md, "Model bundle".
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

from raycompat import console
from raycompat.config import (
    ConfigError,
    add_options,
    choices,
    make_parser,
    option,
    options_from_args,
    positive,
)

__all__ = ["ImportModelOptions", "build_parser", "import_model", "main"]


@dataclass(frozen=True)
class ImportModelOptions:
    """Options of ``raycompat import-model``."""

    timm: str | None = option(None, help="timm model name of --checkpoint")
    checkpoint: str | None = option(None, help="local checkpoint file of the --timm model")
    torchscript: str | None = option(None, help="a TorchScript embedder file (instead of --timm)")
    embed_dim: int | None = option(None, min=1, help="the model's embedding size (required)")
    in_chans: int = positive(3, help="input channels the model takes")
    resolution: int = positive(224, help="input image size (pixels per side)")
    input_norm: str = choices(
        "none", "unit", "imagenet", default="none", help="the pixel convention the model expects"
    )
    out: str | None = option(None, help="the bundle folder to write (required)")
    overwrite: bool = option(False, help="replace an existing model bundle at --out")


def build_parser() -> argparse.ArgumentParser:
    parser = make_parser("import-model", __doc__)
    add_options(parser, ImportModelOptions)
    return parser


def check_options(opts: ImportModelOptions) -> None:
    """The flags that must (not) go together, and ``--out``; raises ``ConfigError``."""
    if bool(opts.timm) == bool(opts.torchscript):
        raise ConfigError("give exactly one of --timm NAME (with --checkpoint) or --torchscript")
    if opts.timm and not opts.checkpoint:
        raise ConfigError(f"--timm {opts.timm!r} needs --checkpoint FILE (its weights)")
    if opts.torchscript and opts.checkpoint:
        raise ConfigError("--checkpoint goes with --timm; a TorchScript file holds its weights")
    if opts.embed_dim is None:
        raise ConfigError("--embed-dim is required (the model's embedding size)")
    if not opts.out:
        raise ConfigError("--out is required (the bundle folder to write)")
    check_out(opts.out, opts.overwrite)


def check_out(out: str, overwrite: bool) -> None:
    """``out`` must be a new local path, or with ``overwrite`` an existing model bundle."""
    from raycompat.storage import is_uri

    if is_uri(out):
        raise ConfigError(f"--out {out!r}: write the bundle to a local folder, then upload it")
    path = os.path.expanduser(out)
    if not os.path.exists(path):
        return
    if not overwrite:
        raise ConfigError(f"--out {out!r} already exists; pass --overwrite to replace it")
    if not os.path.isfile(os.path.join(path, "manifest.json")):
        raise ConfigError(f"--out {out!r} exists and is not a model bundle; not replacing it")


def import_model(opts: ImportModelOptions):
    """The imported model (:class:`raycompat.models.imported.ImportedModel`) of ``opts``."""
    from raycompat.models.imported import import_timm, import_torchscript

    if opts.timm:
        return import_timm(
            opts.timm,
            opts.checkpoint,
            opts.embed_dim,
            opts.in_chans,
            opts.resolution,
            opts.input_norm,
        )
    return import_torchscript(
        opts.torchscript, opts.embed_dim, opts.in_chans, opts.resolution, opts.input_norm
    )


def check_round_trip(model, path: str, in_chans: int, resolution: int) -> None:
    """The saved bundle, loaded back, embeds a random batch as the imported model does."""
    import torch

    from raycompat.models import ModelBundle

    x = torch.rand(2, in_chans, resolution, resolution, generator=torch.Generator().manual_seed(0))
    x = x * 2 - 1
    with torch.no_grad():
        want = model.embedder.eval()(x)
        got = ModelBundle.load(path).embedder(x)
    if not torch.allclose(want, got, rtol=1e-4, atol=1e-5):
        raise ConfigError(f"the bundle saved at {path!r} does not reproduce the model's output")


@console.job_main
def main(argv: list[str] | None = None) -> int:
    opts = options_from_args(ImportModelOptions, build_parser().parse_args(argv))
    check_options(opts)
    started = time.time()
    from raycompat.models.bundle import imported_bundle

    model = import_model(opts)
    path = imported_bundle(model, opts.resolution).save(os.path.expanduser(opts.out))
    check_round_trip(model, path, opts.in_chans, opts.resolution)
    console.phase(
        "import-model",
        f"{model.form} model {model.backbone!r} from {model.source}: embed_dim "
        f"{opts.embed_dim}, in_chans {opts.in_chans}, resolution {opts.resolution}, "
        f"input_norm {opts.input_norm}, no classifier head; bundle {path}",
        time.time() - started,
    )
    return 0
