"""Small random-init model bundles for smoke runs, tests and benchmarks (no training), with
their BatchNorm statistics calibrated on noise images.  A bundle's fingerprint and manifest:
:mod:`raycompat.models.fingerprint`."""

from __future__ import annotations

import os

from raycompat.models.fingerprint import bundle_fingerprint


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
