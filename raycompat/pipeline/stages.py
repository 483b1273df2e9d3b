"""Ray Data stages of the gallery pipeline (``map_batches`` callables, numpy batches).

item ids -> ``load_images`` (decode / render) ->
``preprocess`` (uint8 -> float pixels in [-1, 1]) -> :class:`EmbedStage` ``old`` and ``new``
(actor pools, one model each) -> :class:`OldFeatureStage` (actor pool: psi(old) for DMU's
forward adaptation and RACT Eq.9-11 uncertainty of old features under the new head; no image).

Each embedding stage adds an internal column ``__node_<stage>`` (``new``, ``old``, ``adapt``):
the Ray node id of the actor that computed the row. The shard writer records these per
shard and in ``_summary.json`` and never stores them as data columns.
"""

from __future__ import annotations

import numpy as np

NODE_PREFIX = "__node_"  # internal per-row column prefix: the node that ran a stage
UNCERTAINTY_COLUMNS = {
    "least_confidence": "unc_least_confidence",
    "margin": "unc_margin",
    "entropy": "unc_entropy",
}


def load_images(batch: dict, source, on_corrupt: str) -> dict:
    """Decode or render the items of ``batch['item_id']`` (uint8 ``image``, ``error`` message
    for a skipped corrupt image, empty otherwise)."""
    return source.load(np.asarray(batch["item_id"], np.int64), on_corrupt)


def preprocess(batch: dict) -> dict:
    """uint8 ``image`` (N, H, W) or (N, H, W, C) -> float32 ``pixels`` (N, C, H, W) in [-1, 1],
    the scaling of ``raycompat.data.images_to_tensor``."""
    images = np.asarray(batch.pop("image"))
    x = images.astype(np.float32) / np.float32(127.5) - np.float32(1.0)
    batch["pixels"] = x[:, None] if x.ndim == 3 else np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    return batch


def current_node_id() -> str:
    """The Ray node id of this process ("" outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id() or ""
    except Exception:  # where the work ran is a report, never a reason to fail
        pass
    return ""


def _mark_node(batch: dict, stage: str, node_id: str) -> None:
    n = len(batch["item_id"])
    batch[NODE_PREFIX + stage] = np.full(n, node_id, dtype=f"<U{max(len(node_id), 1)}")


def _device(use_gpu: bool):
    import torch

    return torch.device("cuda" if use_gpu and torch.cuda.is_available() else "cpu")


def _set_threads(threads: int) -> None:
    import torch

    if threads > 0:
        torch.set_num_threads(int(threads))


class EmbedStage:
    """One embedder (the old or the new model) over ``pixels`` -> ``column``: raw float32
    ``phi(x)`` as ``raycompat.evaluation.embed_glyphs`` returns (retrieval L2-normalises)."""

    def __init__(
        self,
        bundle_path: str,
        column: str,
        threads: int = 1,
        use_gpu: bool = False,
        drop_pixels: bool = False,
    ):
        from raycompat.models import ModelBundle

        _set_threads(threads)
        self.device = _device(use_gpu)
        bundle = ModelBundle.load(bundle_path, device=self.device)
        self.embedder = bundle.embedder.eval()
        self.in_chans = int(bundle.embedder.spec.get("in_chans", 1))
        self.column = column
        self.drop_pixels = drop_pixels
        self.node_id = current_node_id()

    def __call__(self, batch: dict) -> dict:
        import torch

        pixels = batch["pixels"]
        if not (
            pixels.flags.writeable and pixels.flags.c_contiguous
        ):  # Ray hands out read-only views
            pixels = np.array(pixels, dtype=np.float32, order="C")
        x = torch.from_numpy(pixels)
        if x.shape[1] != self.in_chans:  # channel conversion as raycompat.data.to_tensor
            x = x.expand(-1, self.in_chans, -1, -1) if x.shape[1] == 1 else x.mean(1, keepdim=True)
        with torch.inference_mode():
            out = self.embedder(x.to(self.device)).float().cpu().numpy()
        batch[self.column] = out
        if self.drop_pixels:
            del batch["pixels"]
        _mark_node(batch, self.column, self.node_id)
        return batch


class OldFeatureStage:
    """Gallery-side operations on old features (docs/methods.md, "Gallery-side operations"), no
    image and no backbone pass: ``adapted = psi(old)`` (DMU forward adaptation) and the
    uncertainty of ``old`` under the new head ``w_n`` (RACT Eq.9-11, via
    ``raycompat.backfill.policies.uncertainty_scores``)."""

    def __init__(
        self,
        new_bundle_path: str,
        adapt: bool,
        uncertainty: bool,
        drop_old: bool = False,
        threads: int = 1,
        use_gpu: bool = False,
    ):
        from raycompat.backfill.policies import UncertaintyHead
        from raycompat.models import ModelBundle

        _set_threads(threads)
        self.device = _device(use_gpu)
        bundle = ModelBundle.load(new_bundle_path, device=self.device)
        self.psi = bundle.modules["psi"].eval() if adapt else None
        self.head = UncertaintyHead.from_classifier_head(bundle.head) if uncertainty else None
        self.drop_old = drop_old
        self.node_id = current_node_id()

    def __call__(self, batch: dict) -> dict:
        import torch

        old = np.array(batch["old"], dtype=np.float32, order="C")
        if self.psi is not None:
            with torch.inference_mode():
                batch["adapted"] = (
                    self.psi(torch.from_numpy(old).to(self.device)).float().cpu().numpy()
                )
        if self.head is not None:
            from raycompat.backfill.policies import uncertainty_scores

            for kind, column in UNCERTAINTY_COLUMNS.items():
                batch[column] = uncertainty_scores(old, self.head, kind)
        if self.drop_old:
            del batch["old"]
        _mark_node(batch, "adapt", self.node_id)
        return batch
