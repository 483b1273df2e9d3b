"""Random-init bundles (smoke runs and benchmarks) must embed different images differently."""

from __future__ import annotations

import torch

from raycompat.models import ModelBundle
from raycompat.pipeline.bundles import make_random_bundles


def test_random_init_bundles_are_not_constant(tmp_path):
    old_path, new_path = make_random_bundles(str(tmp_path))
    x = torch.rand(32, 1, 32, 32) * 2 - 1
    for path in (old_path, new_path):
        bundle = ModelBundle.load(path).eval()
        with torch.no_grad():
            e = torch.nn.functional.normalize(bundle.embedder(x), dim=-1)
        cos = e @ e.T
        off_diagonal = cos[~torch.eye(len(x), dtype=torch.bool)]
        # uncalibrated BatchNorm made every embedding equal (cosine 1.0 everywhere)
        assert off_diagonal.max() < 0.99, (path, off_diagonal.max().item())
        assert e.std(0).mean() > 1e-2
    # reused when asked again with the same arguments: same weights
    again = ModelBundle.load(make_random_bundles(str(tmp_path))[0]).eval()
    with torch.no_grad():
        assert torch.equal(again.embedder(x), ModelBundle.load(old_path).eval().embedder(x))


def test_bundles_load_inside_no_grad(tmp_path):
    old_path, _ = make_random_bundles(str(tmp_path))
    with torch.no_grad():
        bundle = ModelBundle.load(old_path)
    assert bundle.embedder.embed_dim == 64
