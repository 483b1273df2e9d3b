"""What the Serve tests share: the admin token, a labelled gallery, and deploying an app."""

import numpy as np

from raycompat.backfill import GalleryEmbeddings

TOKEN = "test-admin-token-0123456789"
APP = "raycompat-test"


def labelled_embeddings(n_items=600, n_queries=60, classes=30, d_old=16, d_new=24, seed=0):
    """Clustered old/new/adapted embeddings; the new model's first d_old dims are compatible."""
    rng = np.random.default_rng(seed)
    c_old = rng.standard_normal((classes, d_old))
    c_new = np.concatenate(
        [
            c_old + 0.3 * rng.standard_normal((classes, d_old)),
            rng.standard_normal((classes, d_new - d_old)),
        ],
        axis=1,
    )
    g_lab = rng.integers(0, classes, n_items)
    q_lab = rng.integers(0, classes, n_queries)

    def draw(centers, lab, s):
        return (centers[lab] + s * rng.standard_normal((lab.size, centers.shape[1]))).astype(
            np.float32
        )

    g_new = draw(c_new, g_lab, 0.9)
    return GalleryEmbeddings(
        gallery_labels=g_lab,
        gallery_old=draw(c_old, g_lab, 1.2),
        gallery_new=g_new,
        gallery_adapted=(g_new + 0.8 * rng.standard_normal(g_new.shape)).astype(np.float32),
        query_labels=q_lab,
        query_old=draw(c_old, q_lab, 1.2),
        query_new=draw(c_new, q_lab, 0.9),
        gallery_ids=np.arange(n_items, dtype=np.int64) * 7 + 3,
        query_ids=np.arange(n_queries, dtype=np.int64) + 10_000_000,
    )


def deploy(port, state_dir, gallery, token_file=None, app=APP, prefix="/", **kw):

    from raycompat.serving.app import build_app
    from raycompat.serving.client import ServingClient
    from raycompat.serving.config import serving_config
    from raycompat.serving.deploy import run_application

    kw.setdefault("router_replicas", 1)  # the default (0: two where there are CPUs) costs more
    cfg = serving_config(
        gallery=gallery,
        state_dir=str(state_dir),
        port=port,
        app_name=app,
        token_file=token_file,
        route_prefix=prefix,
        **kw,
    )
    run_application(cfg, build_app(cfg))
    client = ServingClient(f"http://127.0.0.1:{port}{prefix.rstrip('/')}", token=TOKEN)
    client.wait_ready()
    return cfg, client
