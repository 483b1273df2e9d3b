"""The models a gallery run uses: old and new bundles (psi and the new head live in the new
bundle), their fingerprints for the output manifest, and small random-init bundles for smoke
runs, tests and benchmarks (no training)."""

from __future__ import annotations

import hashlib
import os

from raycompat.config import ConfigError

_LOCAL_COPIES: dict[str, str] = {}


def _local_bundle(path: str) -> str:
    """A bundle at a URI (``s3://.../models/old``) is read from a local copy, made once per
    process; the model actors load the URI themselves (``ModelBundle.load``)."""
    from raycompat.storage import is_uri, local_copy

    if not is_uri(path):
        return os.path.expanduser(path)
    if path not in _LOCAL_COPIES:
        try:
            _LOCAL_COPIES[path] = local_copy(path)
        except FileNotFoundError as exc:
            raise ConfigError(f"no model bundle at {path!r}: {exc}") from None
    return _LOCAL_COPIES[path]


def bundle_fingerprint(path: str) -> str:
    """sha256 (16 hex) of a saved bundle's manifest and weight files: equal fingerprints mean
    equal models, so a resumed run cannot mix vectors of two different models. ``path``: a
    folder or a storage URI."""
    path = _local_bundle(path)
    if not os.path.isfile(os.path.join(path, "manifest.json")):
        raise ConfigError(f"no model bundle at {path!r}: manifest.json is missing")
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        if name == "manifest.json" or name.endswith(".pt"):
            h.update(name.encode() + b"\0")
            with open(os.path.join(path, name), "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()[:16]


def check_predecessor(old_path: str, new_path: str, allow_unrelated: bool = False) -> str | None:
    """Whether the new model was trained against this old model: ``None`` when the
    predecessor fingerprint the new bundle records equals the old bundle's; a warning when
    the new bundle records none (an older bundle, or one trained without an old model) or
    when they differ and ``allow_unrelated``; ``ConfigError`` when they differ otherwise."""
    predecessor = read_manifest(new_path).get("predecessor") or {}
    recorded = predecessor.get("fingerprint")
    if recorded is None:
        why = "an older bundle" if predecessor else "no predecessor in its manifest"
        return (
            f"new model {new_path} records no predecessor fingerprint ({why}): cannot check "
            f"that it was trained against --old-model {old_path}"
        )
    actual = bundle_fingerprint(old_path)
    if recorded == actual:
        return None
    message = (
        f"new model {new_path} was trained against old model {recorded} "
        f"({predecessor.get('path')}), but --old-model {old_path} is {actual}"
    )
    if allow_unrelated:
        return message + " (--allow-unrelated: used together anyway)"
    raise ConfigError(message + ": pass --allow-unrelated to use them together anyway")


def read_manifest(path: str) -> dict:
    import json

    bundle_fingerprint(path)  # existence check with a clear error
    with open(os.path.join(_local_bundle(path), "manifest.json")) as fh:
        return json.load(fh)


def embedder_info(path: str) -> dict:
    """``{embed_dim, in_chans, resolution, modules}`` from a bundle manifest (no weights loaded)."""
    manifest = read_manifest(path)
    modules = manifest.get("modules", {})
    spec = modules.get("embedder")
    if spec is None:
        raise ConfigError(f"model bundle {path!r} has no 'embedder' module (has {sorted(modules)})")
    return {
        "embed_dim": int(spec["embed_dim"]),
        "in_chans": int(spec.get("in_chans", manifest.get("in_chans", 1))),
        "resolution": manifest.get("resolution"),
        "modules": sorted(modules),
        "psi_dims": (int(modules["psi"]["in_dim"]), int(modules["psi"]["out_dim"]))
        if "psi" in modules
        else None,
    }


def calibrate_batchnorm(
    embedder, resolution: int, seed: int, batches: int = 4, batch_size: int = 64
) -> None:
    """Set the BatchNorm running statistics of a random-init embedder from a few forward passes
    on noise images. Without it, timm's default statistics (mean 0, var 1) let activations
    shrink layer by layer in eval mode (LCNet: ~1e-9 after the last block), and every input
    gets the same embedding: a smoke gallery of identical vectors."""
    import torch

    norms = [m for m in embedder.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the calibration batches
    gen = torch.Generator().manual_seed(seed)
    in_chans = int(embedder.spec.get("in_chans", 1))
    embedder.train()
    with torch.no_grad():
        for _ in range(batches):
            embedder(
                torch.rand(batch_size, in_chans, resolution, resolution, generator=gen) * 2 - 1
            )
    for m in norms:
        m.momentum = 0.1
    embedder.eval()


def make_random_bundles(
    out_dir: str,
    backbone: str = "lcnet_050",
    old_dim: int = 64,
    new_dim: int = 128,
    num_classes: int = 100,
    psi_hidden: int = 1024,
    resolution: int = 32,
    seed: int = 0,
    head: str = "cosface",
) -> tuple[str, str]:
    """Save a random-init old bundle (embedder + head) and new bundle (embedder + head + psi)
    under ``out_dir``; returns ``(old_path, new_path)``. Deterministic in ``seed``; existing
    bundles made with the same arguments are reused."""
    import json

    import torch

    from raycompat.models import ClassifierHead, Embedder, ModelBundle, PsiMLP

    args = dict(
        backbone=backbone,
        old_dim=old_dim,
        new_dim=new_dim,
        num_classes=num_classes,
        psi_hidden=psi_hidden,
        resolution=resolution,
        seed=seed,
        head=head,
        bn_calibrated=True,
        predecessor_fingerprint=True,
    )
    paths = (os.path.join(out_dir, "old"), os.path.join(out_dir, "new"))
    stamp = os.path.join(out_dir, "random_init.json")
    if all(os.path.isfile(os.path.join(p, "manifest.json")) for p in paths) and os.path.isfile(
        stamp
    ):
        with open(stamp) as fh:
            if json.load(fh) == args:
                return paths
    common = dict(
        in_chans=1, resolution=resolution, classes=list(range(num_classes)), random_init=True
    )
    torch.manual_seed(seed)
    old = ModelBundle(
        {
            "embedder": Embedder(backbone, old_dim),
            "head": ClassifierHead(old_dim, num_classes, head),
        },
        dict(common, method="random-init old"),
    )
    torch.manual_seed(seed + 1)
    new = ModelBundle(
        {
            "embedder": Embedder(backbone, new_dim),
            "head": ClassifierHead(new_dim, num_classes, head),
            "psi": PsiMLP(old_dim, new_dim, hidden_dim=psi_hidden),
        },
        dict(common, method="random-init new", compatible_dim=min(old_dim, new_dim)),
    )
    for bundle, path in zip((old, new), paths, strict=False):
        calibrate_batchnorm(bundle.embedder, resolution, seed)
        if bundle is new:  # the new model records its predecessor, as a trained one does
            new.manifest["predecessor"] = {
                "path": paths[0],
                "fingerprint": bundle_fingerprint(paths[0]),
            }
        bundle.eval().save(path)
    os.makedirs(out_dir, exist_ok=True)
    with open(stamp, "w") as fh:
        json.dump(args, fh)
    return paths
