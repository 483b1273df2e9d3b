"""GlyphDataset over scenario splits."""

from __future__ import annotations

import numpy as np
import torch

from raycompat.data import GlyphDataset, GlyphRenderer, build_scenario, default_catalog


def test_glyph_dataset():
    catalog = default_catalog()
    s = build_scenario(
        "open-data",
        catalog=catalog,
        num_train_classes=5,
        images_per_class=4,
        num_eval_classes=3,
        num_distractor_classes=0,
        distractors_per_class=0,
    )
    split = s["new_train"]
    ds = GlyphDataset(split, catalog=catalog, resolution=32, seed=1)
    assert len(ds) == len(split) == 15
    x, y = ds[3]
    assert x.shape == (1, 32, 32) and x.dtype == torch.float32 and y == int(split.labels[3])
    assert -1.0 <= float(x.min()) < 0 < float(x.max()) <= 1.0
    cached = GlyphDataset(split, GlyphRenderer(catalog, 32, seed=1), in_chans=3, cache=True)
    assert cached.images.shape == (15, 32, 32)
    x3, y3 = cached[3]
    assert x3.shape == (3, 32, 32) and y3 == y
    assert torch.equal(x3[0], x[0]) and torch.equal(x3[1], x3[2])
    ref = GlyphRenderer(catalog, 32, seed=1).render(split.labels[3], split.instances[3])
    assert np.array_equal(ds.image(3), ref)
    loader = torch.utils.data.DataLoader(ds, batch_size=8)
    xb, yb = next(iter(loader))
    assert xb.shape == (8, 1, 32, 32) and yb.dtype == torch.int64
