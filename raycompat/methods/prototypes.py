"""Class prototypes computed by a distributed pass over the training set, written once for
BCT-sys (synthesised old-classifier rows), P2S, NDPP and ODPP (docs/methods.md, Training
objectives).

Each worker sums the features of its shard per class in float64; the sums and counts are
all-reduced, so every worker ends with the same prototypes, whatever the number of workers.
The embedders run in eval mode, so a sample's feature does not depend on its batch.
Per-item values that a class statistic needs whole (quartiles, a per-class graph) are gathered
from every worker in training-set order instead (``item_features``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from raycompat.torch_distributed import all_reduce_sum, is_distributed, rank, world_size

Features = Callable[["TrainBatch"], torch.Tensor]  # noqa: F821  (a TrainBatch -> [B, D])


@contextmanager
def eval_mode(*modules: nn.Module) -> Iterator[None]:
    """Evaluate with frozen BatchNorm statistics, then restore each module's mode."""
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, mode in zip(modules, modes, strict=False):
            m.train(mode)


def class_sums(
    context,
    num_rows: int,
    features: Mapping[str, tuple[Features, int]],
    row_of_target: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One pass over the training set (``context.epoch_pass_loader``): per-row sums of every
    feature function (``name -> (fn, width)``), float64, all-reduced over workers, and the
    per-row counts. ``row_of_target`` maps a batch's new-head targets to rows (``-1``: skip);
    default identity.
    """
    sums = {
        name: torch.zeros(num_rows, width, dtype=torch.float64, device=context.device)
        for name, (_, width) in features.items()
    }
    counts = torch.zeros(num_rows, dtype=torch.float64, device=context.device)
    with torch.no_grad():
        for batch in context.epoch_pass_loader():
            rows = batch.new_targets if row_of_target is None else row_of_target(batch.new_targets)
            keep = rows >= 0
            if not keep.any():
                continue
            rows = rows[keep]
            counts.index_add_(0, rows, torch.ones_like(rows, dtype=torch.float64))
            for name, (fn, _) in features.items():
                sums[name].index_add_(0, rows, fn(batch)[keep].double())
    for tensor in sums.values():
        all_reduce_sum(tensor)
    all_reduce_sum(counts)
    return sums, counts


def gather_items(local: torch.Tensor) -> torch.Tensor:
    """Per-item rows of an epoch pass from every worker, in training-set order: the shards are
    strided (``shard_indices``: worker r holds items r, r + W, ...), so the result is the same
    tensor whatever the number of workers. Shards may differ in length by one."""
    if not is_distributed():
        return local
    import torch.distributed as dist

    w = world_size()
    sizes = torch.zeros(w, dtype=torch.long, device=local.device)
    sizes[rank()] = local.shape[0]
    all_reduce_sum(sizes)
    padded = local.new_zeros((int(sizes.max()), *local.shape[1:]))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(w)]
    dist.all_gather(parts, padded.contiguous())
    out = local.new_empty((int(sizes.sum()), *local.shape[1:]))
    for r, part in enumerate(parts):
        out[r::w] = part[: int(sizes[r])]
    return out


def item_features(
    context, features: Mapping[str, tuple[Features, int]], modules: tuple[nn.Module, ...] = ()
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One pass over the training set: every item's features (``name -> (fn, width)``, float32,
    ``[N, width]``) and new-head row ``[N]``, gathered in training-set order on every worker
    (``gather_items``), with ``modules`` in eval mode. Each worker then holds ``N x width``
    values per feature."""
    local: dict[str, list[torch.Tensor]] = {name: [] for name in features}
    rows: list[torch.Tensor] = []
    with eval_mode(*modules):
        for batch in context.epoch_pass_loader():
            rows.append(batch.new_targets)
            for name, (fn, _) in features.items():
                local[name].append(fn(batch).float())
    device = context.device
    out = {
        name: gather_items(torch.cat(local[name]) if rows else torch.zeros(0, w, device=device))
        for name, (_, w) in features.items()
    }
    all_rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long, device=device)
    return out, gather_items(all_rows)


def class_mean_features(context, num_rows: int, row_of_target) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class sums of the frozen old embedding ``phi_o(x)`` (raw, as BCT-sys synthesises
    classifier rows from it) and the counts; see ``class_sums``."""
    old = context.old.embedder
    with eval_mode(old):
        sums, counts = class_sums(
            context, num_rows, {"old": (lambda b: old(b.x_old), old.embed_dim)}, row_of_target
        )
    return sums["old"], counts


def unknown_class_rows(context) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(old_row_of_new_target, synth_row_of_new_target, n_unseen)``: for every new-head
    target, its old-classifier row (``-1`` for a class the old head lacks) and the row a
    synthesised classifier row gives it (``len(old_classes) + j`` for the j-th unseen class,
    ``-1`` for a known one)."""
    old_rows = {c: i for i, c in enumerate(context.old_classes)}
    mapping = torch.tensor([old_rows.get(c, -1) for c in context.new_classes], dtype=torch.long)
    unseen = (mapping < 0).nonzero().flatten()
    synth = torch.full_like(mapping, -1)
    synth[unseen] = len(context.old_classes) + torch.arange(len(unseen))
    return mapping, synth, len(unseen)


def synthesised_rows(context, synth_row_of_new_target: torch.Tensor, n_rows: int, owner: str):
    """The synthesised old-classifier rows (BCT-sys; DMU for classes the old head lacks): the
    class mean of the frozen ``phi_o(x)`` over the new training set, ``[n_rows, D_o]``."""
    base = len(context.old_classes)
    sums, counts = class_mean_features(
        context,
        n_rows,
        lambda t: torch.where(
            synth_row_of_new_target[t] >= 0, synth_row_of_new_target[t] - base, -1
        ),
    )
    if (counts == 0).any():
        missing = int((counts == 0).sum())
        raise RuntimeError(f"{owner}: {missing} new classes have no training sample")
    return (sums / counts[:, None]).float()


def class_prototypes(
    context,
    num_rows: int,
    features: Mapping[str, tuple[Features, int]],
    modules: tuple[nn.Module, ...] = (),
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Prototypes ``p^c = mean_{x in c} f(x)`` (float32) for every ``name -> (fn, width)``, over the
    rows of the new head (every class of the new training set, classes unseen by the old
    model included), with ``modules`` in eval mode during the pass; and the per-class counts."""
    with eval_mode(*modules):
        sums, counts = class_sums(context, num_rows, features)
    if (counts == 0).any():
        missing = [int(i) for i in (counts == 0).nonzero().flatten()[:5]]
        raise RuntimeError(f"classes (new-head rows) {missing} have no training sample")
    return {name: (s / counts[:, None]).float() for name, s in sums.items()}, counts


def normalised_old_features(context) -> tuple[Features, int]:
    """``normalize(phi_o(x_old))``: the old-space feature of P2S prototypes (NDPP Eq.2)."""
    old = context.old.embedder
    return (lambda batch: F.normalize(old(batch.x_old), dim=1)), old.embed_dim


def normalised_new_features(embedder: nn.Module, compatible_dim: int) -> tuple[Features, int]:
    """``normalize(phi_n(x_new)[:D_o])``: new prototypes in the compatible subspace."""
    return (
        lambda batch: F.normalize(embedder(batch.x_new)[:, :compatible_dim], dim=1)
    ), compatible_dim


def prototype_logits(
    emb: torch.Tensor,
    targets: torch.Tensor,
    negatives: torch.Tensor,
    tau: float,
    positives: torch.Tensor | None = None,
) -> torch.Tensor:
    """``cos(e_n, P) / tau`` against every prototype row (P2S, NDPP Eq.2); with ``positives``
    the target column uses ``cos(e_n, p_hat^y)`` instead and every other column keeps the real
    prototype (NDPP Eq.6: pseudo-old positive, real old negatives)."""
    e = F.normalize(emb, dim=1)
    logits = e @ F.normalize(negatives, dim=1).t()
    if positives is not None:
        pos = (e * F.normalize(positives[targets], dim=1)).sum(dim=1, keepdim=True)
        logits = logits.scatter(1, targets[:, None], pos)
    return logits / tau


def old_class_centres(context, classes: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(centres, counts)`` per new-head row: the mean of ``normalize(phi_o(x))`` over the new
    training set (float32 ``[K_n, D_o]``, not re-normalised) and the number of items. ``classes``:
    ``old`` gives centres to the classes the old model knows only (count 0 and a zero centre
    for the others), ``all`` to every class of the new training set (LCE, AdvBCT)."""
    known = unknown_class_rows(context)[0] >= 0
    keep = known if classes == "old" else torch.ones_like(known)
    keep = keep.to(context.device)
    num_rows = len(context.new_classes)
    with eval_mode(context.old.embedder):
        sums, counts = class_sums(
            context,
            num_rows,
            {"old": normalised_old_features(context)},
            lambda t: torch.where(keep[t], t, -1),
        )
    return (sums["old"] / counts.clamp(min=1.0)[:, None]).float(), counts
