"""Draws docs/images/where_the_gallery_lives.png (docs/live-index.md, "Where the gallery lives").

bash .ci/env python docs/images/where_the_gallery_lives.py
"""

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

STORE = (
    "the store\n(a LanceDB table)\n\nid, label,\nold, new,\nold_model, new_model,\nupgraded, "
    "position,\nwrite_seq\n\nthe gallery's\none home"
)
#: name -> (x, y, width, height, text)
BOXES = {
    "client": (0.02, 0.72, 0.16, 0.16, "clients\n(HTTP)"),
    "router": (0.26, 0.72, 0.18, 0.16, "router\n(2 replicas)"),
    "ctl": (
        0.26,
        0.2,
        0.18,
        0.22,
        "backfill controller\nthe one writer:\nupserts, batches,\nrollback, finalize",
    ),
    "s0": (0.54, 0.72, 0.18, 0.16, "shard 0 replicas\nin-memory indexes"),
    "s1": (0.54, 0.48, 0.18, 0.16, "shard 1 replicas\nin-memory indexes"),
    "store": (0.8, 0.2, 0.19, 0.68, STORE),
}
#: (from, to, label, label position): arrows between box edges
ARROWS = [
    ((0.18, 0.80), (0.26, 0.80), "search, upsert,\nadmin", (0.22, 0.90)),
    ((0.44, 0.80), (0.54, 0.80), "search", (0.49, 0.82)),
    ((0.44, 0.76), (0.54, 0.56), "", None),
    ((0.35, 0.72), (0.35, 0.42), "upserts", (0.39, 0.56)),
    ((0.44, 0.30), (0.80, 0.30), "one commit per batch or upsert group", (0.62, 0.32)),
    ((0.80, 0.80), (0.72, 0.80), "", None),
    ((0.80, 0.56), (0.72, 0.56), "", None),
]
NOTE = (
    "A shard replica keeps no file: at start it loads its rows (id hash mod shards) from the "
    "store, then follows the store's commits;\nresharding is a restart with another "
    "--num-shards. The controller's checkpoint is the index's only file (<state_dir>/backfill)."
)


def main() -> None:
    fig, ax = plt.subplots(figsize=(10, 5.2))
    ax.set_axis_off()
    for name, (x, y, w, h, text) in BOXES.items():
        color = "#fde9c4" if name == "store" else "#dbe8f6"
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.01", fc=color, ec="#333"))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8.5)
    for p, q, label, at in ARROWS:
        ax.add_patch(FancyArrowPatch(p, q, arrowstyle="-|>", mutation_scale=12, color="#333"))
        if label:
            ax.text(*at, label, ha="center", fontsize=7.5)
    ax.text(0.76, 0.665, "follow: rows with\nwrite_seq > last", ha="center", fontsize=7.5)
    ax.text(0.02, 0.06, NOTE, fontsize=8)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "where_the_gallery_lives.png")
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(out)


if __name__ == "__main__":
    main()
