"""Ray Data stages of the gallery pipeline (``map_batches`` callables, numpy batches).

item ids -> ``load_images`` (decode / render) ->
``preprocess`` (uint8 -> float pixels in [-1, 1]) -> :class:`EmbedStage` ``old`` and ``new``
(actor pools, one model each) -> :class:`OldFeatureStage` (actor pool: psi(old) for DMU's
forward adaptation and RACT Eq.9-11 uncertainty of old features under the new head; no image).
With ``--model-stages tasks`` the model stages run as Ray tasks instead (:data:`TASKS`), each
worker process keeping its most recent stage objects (:func:`cached_stage`).

Each embedding stage adds an internal column ``__node_<stage>`` (``new``, ``old``, ``adapt``):
the Ray node id of the actor that computed the row. The shard writer records these per
shard and in ``_summary.json`` and never stores them as data columns. ``__plan_pos`` (set with
the ids, carried by ``load_images``) is each row's position in the run's ``IdPlan``.

Same output whatever Ray Data's batching: every model pass (old, new, psi and the
uncertainty head) runs on a fixed sub-batch of ids, ``raycompat.pipeline.ids.ForwardBatches``
of the stage's batch size, with each row in its fixed place and zeros for the sub-batch's ids
that are not in the batch Ray Data handed over (rows never influence one another). CPU BLAS and
oneDNN round by batch shape, so the same rows always go through the same shapes: a run, and a
resumed run, writes bit-identical vectors whatever Ray Data's block and batch sizes, task order
or actor, on the same machine (same CPU or GPU, same torch build) with the same torch thread
count (``--threads``) and the same model-stage batch sizes (other sizes round in the last bits).
The cost: a sub-batch that Ray Data split across batches is computed once per piece.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np

NODE_PREFIX = "__node_"  # internal per-row column prefix: the node that ran a stage
POSITION_COLUMN = "__plan_pos"  # internal per-row column: the row's position in the IdPlan
UNCERTAINTY_COLUMNS = {
    "least_confidence": "unc_least_confidence",
    "margin": "unc_margin",
    "entropy": "unc_entropy",
}


def load_images(batch: dict, source, on_corrupt: str) -> dict:
    """Decode or render the items of ``batch['item_id']`` (uint8 ``image``, ``error`` message
    for a skipped corrupt image, empty otherwise), keeping their plan positions."""
    loaded = source.load(np.asarray(batch["item_id"], np.int64), on_corrupt)
    loaded[POSITION_COLUMN] = np.asarray(batch[POSITION_COLUMN], np.int64)
    return loaded


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


def by_fixed_batches(fn, values, positions, batches) -> dict[str, np.ndarray]:
    """``fn`` (float32 array of one whole sub-batch -> ``{column: one value per row}``) over
    the rows of ``values`` at plan ``positions``, each row computed in its fixed sub-batch of
    ``batches`` (a ``ForwardBatches``) and place: rows of a sub-batch missing here are zeros.
    The sub-batch lives in torch's 64-byte aligned memory, so its alignment is fixed too."""
    import torch

    values = np.asarray(values)
    out: dict[str, np.ndarray] = {}
    for rows, length, offsets in batches.split(positions):
        group = torch.zeros((length, *values.shape[1:]), dtype=torch.float32).numpy()
        group[offsets] = values[rows]
        for column, result in fn(group).items():
            result = np.asarray(result)
            if column not in out:
                out[column] = np.empty((len(values), *result.shape[1:]), result.dtype)
            out[column][rows] = result[offsets]
    if not len(values):  # an empty batch: the columns, with no rows
        out = {c: np.asarray(r)[:0] for c, r in fn(values.astype(np.float32)).items()}
    return out


class EmbedStage:
    """One embedder (the old or the new model) over ``pixels`` -> ``column``: raw float32
    ``phi(x)`` as ``raycompat.evaluation.embed_glyphs`` returns (retrieval L2-normalises), in
    the fixed sub-batches ``batches`` (a ``ForwardBatches``)."""

    def __init__(
        self,
        bundle_path: str,
        column: str,
        batches,
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
        self.batches = batches
        self.drop_pixels = drop_pixels
        self.node_id = current_node_id()

    def _embed(self, pixels: np.ndarray) -> dict:
        import torch

        x = torch.from_numpy(pixels)
        if x.shape[1] != self.in_chans:  # channel conversion as raycompat.data.to_tensor
            x = x.expand(-1, self.in_chans, -1, -1) if x.shape[1] == 1 else x.mean(1, keepdim=True)
        with torch.inference_mode():
            return {self.column: self.embedder(x.to(self.device)).float().cpu().numpy()}

    def __call__(self, batch: dict) -> dict:
        batch.update(
            by_fixed_batches(self._embed, batch["pixels"], batch[POSITION_COLUMN], self.batches)
        )
        if self.drop_pixels:
            del batch["pixels"]
        _mark_node(batch, self.column, self.node_id)
        return batch


class OldFeatureStage:
    """Gallery-side operations on old features (docs/methods.md, "Gallery-side operations"), no
    image and no backbone pass: ``adapted = psi(old)`` (DMU forward adaptation) and the
    uncertainty of ``old`` under the new head ``w_n`` (RACT Eq.9-11, via
    ``raycompat.upgrade.policies.uncertainty_scores``), in the fixed sub-batches ``batches``."""

    def __init__(
        self,
        new_bundle_path: str,
        adapt: bool,
        uncertainty: bool,
        batches,
        drop_old: bool = False,
        threads: int = 1,
        use_gpu: bool = False,
    ):
        from raycompat.models import ModelBundle
        from raycompat.models.uncertainty_head import UncertaintyHead

        _set_threads(threads)
        self.device = _device(use_gpu)
        bundle = ModelBundle.load(new_bundle_path, device=self.device)
        self.psi = bundle.modules["psi"].eval() if adapt else None
        self.head = UncertaintyHead.from_classifier_head(bundle.head) if uncertainty else None
        self.batches = batches
        self.drop_old = drop_old
        self.node_id = current_node_id()

    def _features(self, old: np.ndarray) -> dict:
        import torch

        out = {}
        if self.psi is not None:
            with torch.inference_mode():
                out["adapted"] = (
                    self.psi(torch.from_numpy(old).to(self.device)).float().cpu().numpy()
                )
        if self.head is not None:
            from raycompat.upgrade.policies import uncertainty_scores

            for kind, column in UNCERTAINTY_COLUMNS.items():
                out[column] = uncertainty_scores(old, self.head, kind)
        return out

    def __call__(self, batch: dict) -> dict:
        batch.update(
            by_fixed_batches(self._features, batch["old"], batch[POSITION_COLUMN], self.batches)
        )
        if self.drop_old:
            del batch["old"]
        _mark_node(batch, "adapt", self.node_id)
        return batch


#: stage objects that ``tasks`` mode built in this worker process, least recently used first
_CACHE: OrderedDict = OrderedDict()
#: at most this many (loaded models) per worker process
CACHED_STAGES = 4


def cached_stage(cls, fingerprint: str, **kwargs):
    """``cls(**kwargs)``, built once per worker process for the same class, model bundle
    ``fingerprint`` and arguments; the :data:`CACHED_STAGES` most recently used are kept.
    ``batches`` (the run's fixed sub-batches) is not part of the key: a cached stage takes
    the current run's, so the runs of different galleries share one loaded model."""
    batches = kwargs.pop("batches", None)
    key = (cls, fingerprint, tuple(sorted(kwargs.items())))
    stage = _CACHE.pop(key, None)
    if stage is None:
        stage = cls(**kwargs, **({} if batches is None else {"batches": batches}))
    elif batches is not None:
        stage.batches = batches
    _CACHE[key] = stage
    while len(_CACHE) > CACHED_STAGES:
        _CACHE.popitem(last=False)
    return stage


def _run_cached(cls, batch: dict, fingerprint: str, kwargs: dict) -> dict:
    """``batch`` through this worker's cached ``cls`` stage. A task that Ray cancels (a
    KeyboardInterrupt) while the worker first imports torch would leave torch half-imported
    for every later task of this pooled process, so a cancelled model task ends its worker
    (Ray starts another when needed)."""
    try:
        _set_threads(kwargs["threads"])  # another stage in this process may have set others
        return cached_stage(cls, fingerprint, **kwargs)(batch)
    except KeyboardInterrupt:
        if _in_ray_task():
            os._exit(1)
        raise


def _in_ray_task() -> bool:
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_task_id() is not None


def embed_task(batch: dict, fingerprint: str, **kwargs) -> dict:
    """:class:`EmbedStage` as a Ray task function (its ``kwargs``), cached per worker."""
    return _run_cached(EmbedStage, batch, fingerprint, kwargs)


def old_feature_task(batch: dict, fingerprint: str, **kwargs) -> dict:
    """:class:`OldFeatureStage` as a Ray task function (its ``kwargs``), cached per worker."""
    return _run_cached(OldFeatureStage, batch, fingerprint, kwargs)


#: the task function of each model stage class (``--model-stages tasks``)
TASKS = {EmbedStage: embed_task, OldFeatureStage: old_feature_task}
