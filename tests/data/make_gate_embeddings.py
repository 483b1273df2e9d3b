"""Make ``gate_embeddings.npz``: a glyph gallery embedded by three trained models, for the canary
gate test (tests/serving/test_serving_upgrade.py).

An old model (independent, 32 epochs on half of the images of 24 glyph classes), a BCT model
trained against it and an independent new model (16 epochs on all the images, another seed),
all ``test_resnet`` with 32-dim embeddings at 16 px, trained with Ray Train
(:func:`raycompat.train.runs.train_named`).  The gallery (8 unseen instances of each class) and
the queries (3 other instances) are rendered and embedded by each model.  On this data BCT is
compatible (BCT-old mAP@10 0.65 > old-old 0.58) and the independent model is not (0.03).

    bash .ci/env python tests/data/make_gate_embeddings.py [OUT_DIR]

About 8 minutes on 2 busy CPU cores; the arrays are saved to ``tests/data/gate_embeddings.npz``.
"""

from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
RESOLUTION, EPOCHS, CLASSES, IMAGES, DIM = 16, 16, 24, 40, 32


def scenario():
    from raycompat.data import build_scenario, default_catalog

    return build_scenario(
        "extended-data",
        catalog=default_catalog(),
        num_train_classes=CLASSES,
        images_per_class=IMAGES,
        num_eval_classes=2,
        queries_per_class=1,
        gallery_per_class=1,
        num_distractor_classes=0,
        distractors_per_class=0,
        seed=0,
        old_fraction=0.5,
    )


def train(out: str, scenario) -> dict[str, str]:
    """Train old, independent and BCT; returns their bundle paths."""
    from raycompat.train.runs import train_named

    runs = [
        ("old", "independent", "old_train", None, 2 * EPOCHS, 0),
        ("independent", "independent", "new_train", None, EPOCHS, 1),
        ("bct", "bct", "new_train", "old", EPOCHS, 0),
    ]
    models: dict[str, str] = {}
    for name, method, split, old, epochs, seed in runs:
        values = dict(method=method, backbone="test_resnet", embed_dim=DIM, epochs=epochs,
                      batch_size=64, seed=seed, split=split, scenario=scenario.to_dict(),
                      resolution=RESOLUTION, in_chans=1, data_seed=0, old_model=models.get(old),
                      log_every=1000, threads_per_worker=2)  # fmt: skip
        run, wall = train_named(values, name, "gate", f"{out}/runs", f"{out}/models")
        models[name] = run.bundle_path
        print(f"{name}: {wall:.0f} s", flush=True)
    return models


def embed(models: dict[str, str], scenario) -> dict[str, np.ndarray]:
    """Unseen instances of the training classes: 8 gallery items and 3 queries per class."""
    from raycompat.data import GlyphRenderer, default_catalog
    from raycompat.evaluation import embed_glyphs
    from raycompat.models import ModelBundle

    classes = np.unique(np.asarray(scenario.splits["new_train"].labels))
    g_lab, g_inst = np.repeat(classes, 8), np.tile(np.arange(8), CLASSES) + 1000
    q_lab, q_inst = np.repeat(classes, 3), np.tile(np.arange(3), CLASSES) + 2000
    renderer = GlyphRenderer(default_catalog(), resolution=RESOLUTION, seed=0)
    out = {"g_lab": g_lab, "q_lab": q_lab}
    for name, path in models.items():
        bundle = ModelBundle.load(path)
        out[f"{name}_q"] = embed_glyphs(bundle, renderer, q_lab, q_inst)
        out[f"{name}_g"] = embed_glyphs(bundle, renderer, g_lab, g_inst)
    return out


def main() -> None:
    import ray

    out = sys.argv[1] if len(sys.argv) > 1 else "gate_models"
    os.makedirs(out, exist_ok=True)
    ray.init(address="local", num_cpus=4, logging_level="error")
    glyphs = scenario()
    arrays = embed(train(os.path.abspath(out), glyphs), glyphs)
    np.savez_compressed(os.path.join(HERE, "gate_embeddings.npz"), **arrays)


if __name__ == "__main__":
    main()
