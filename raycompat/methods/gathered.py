"""Global-batch pieces shared by the methods whose loss couples samples of a batch.

Convention (see ``base``): DDP averages the workers' gradients, and every worker holds the
same number of samples. Two ways keep the average equal to the one-process gradient of the
global batch:

- a loss over *all* anchors of the global batch, built from features gathered with
  ``all_gather_with_grad`` (the local slice keeps its gradient), has the same value on every
  worker, and each worker gets the exact partial gradient through its own slice; the sum of
  those is the full gradient, so ``global_batch_loss`` multiplies the gradient (not the value)
  by the world size to undo DDP's average (contrastive, ract, mcl, cl). A loss over the local
  anchors only would not do: the other workers' anchors reach the local keys through
  gathered constants, so their share of the local keys' gradient would be lost;
- a sum of per-sample terms over the global batch, of which each worker holds its share:
  ``local_share`` multiplies that share by the world size (bct-beta mean over known samples,
  dmu's batch-softmax weights).

The gathered contrastive logits of RACT Eq.5/6 (docs/methods.md, Training objectives) are
written here once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raycompat.torch_distributed import all_gather_with_grad, all_reduce_sum, rank, world_size

# Stands in for -inf in masked log-sum-exps: exp() of it is exactly 0, and unlike -inf it
# never turns an empty row's gradient into NaN.
NEG = -1e30


def gather(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """``all_gather_with_grad`` of each tensor (``None`` passes through), in rank order."""
    return tuple(None if t is None else all_gather_with_grad(t) for t in tensors)


def local_slice(global_tensor: torch.Tensor, local_size: int) -> torch.Tensor:
    """This worker's rows of a tensor gathered in rank order."""
    start = rank() * local_size
    return global_tensor[start : start + local_size]


def global_batch_loss(loss: torch.Tensor) -> torch.Tensor:
    """A loss computed identically on every worker over the gathered global batch: same value,
    gradient times the world size (so DDP's average of the workers' partial gradients is the
    full gradient)."""
    w = world_size()
    return loss if w == 1 else loss * w - loss.detach() * (w - 1)


def local_share(local_sum: torch.Tensor) -> torch.Tensor:
    """This worker's part of a sum over the global batch, scaled for DDP's gradient average;
    the mean over workers of the returned values is the global sum."""
    return local_sum * world_size()


def global_mean(values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of per-sample ``values`` over the masked samples of the *global* batch (counts
    all-reduced), as this worker's share. 0 when no sample of the global batch is selected."""
    if mask is None:
        mask = torch.ones_like(values, dtype=torch.bool)
    count = all_reduce_sum(mask.sum().to(torch.float64).detach().clone())
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return local_share(total) / count.clamp(min=1.0).to(values.dtype)


def same_label(labels_a: torch.Tensor, labels_b: torch.Tensor) -> torch.Tensor:
    """[Na, Nb] bool: ``labels_a[i] == labels_b[k]``."""
    return labels_a[:, None] == labels_b[None, :]


def masked_logsumexp(x: torch.Tensor, mask: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """log-sum-exp over the masked entries; ~``NEG`` for a row with none."""
    return torch.logsumexp(x.masked_fill(~mask, NEG), dim=dim)


def compatibility_logits(
    new_part: torch.Tensor,
    old: torch.Tensor,
    labels: torch.Tensor,
    tau: float,
    new_full: torch.Tensor | None = None,
) -> torch.Tensor:
    """RACT Eq.5 / Eq.6 logits (docs/methods.md, Training objectives), target column 0:
    ``[s(n_i,o_i) | s(n_i,o_k) for k | s(n_i,n_k) for k] / tau``.

    Inputs are L2-normalised rows of the global batch. ``new_part`` is the compatible
    subspace (first D_o dims) used against old features; ``new_full`` (ract only; ``None``
    drops the block, i.e. vanilla Eq.5) the whole new embedding used against new ones. Every
    ``k`` with ``y_k == y_i``, i included, is masked (-inf) in both negative blocks.
    """
    positive = (new_part * old).sum(dim=1, keepdim=True)
    intra = same_label(labels, labels)
    blocks = [positive, (new_part @ old.t()).masked_fill(intra, float("-inf"))]
    if new_full is not None:
        blocks.append((new_full @ new_full.t()).masked_fill(intra, float("-inf")))
    return torch.cat(blocks, dim=1) / tau


def compatibility_triplet(
    new_part: torch.Tensor,
    old: torch.Tensor,
    labels: torch.Tensor,
    margin: float,
    new_full: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-anchor triplet form (RACT appendix Eq.14 / Eq.15, docs/methods.md, Training objectives):
    ``mean_{k not in p(i)} [max(0, s(n_i,o_k) - s(n_i,o_i) + m)
    (+ max(0, s(n_i,n_k) - s(n_i,o_i) + m))]``.

    The printed Eq.14/15 reads ``s_pos - s_neg``; as docs/methods.md says, that sign is reversed
    (it would push positives apart), so the hinge here is ``s_neg - s_pos + m``. An anchor with
    no negative in the batch contributes 0. Returns [N] losses.
    """
    positive = (new_part * old).sum(dim=1, keepdim=True)
    negative = ~same_label(labels, labels)
    hinge = F.relu(new_part @ old.t() - positive + margin)
    if new_full is not None:
        hinge = hinge + F.relu(new_full @ new_full.t() - positive + margin)
    hinge = torch.where(negative, hinge, torch.zeros_like(hinge))
    return hinge.sum(dim=1) / negative.sum(dim=1).clamp(min=1)


def hardest_half(distance: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    """Hard mining (RM paper, footnote 2): per row, keep the ceil(n/2) masked entries with the
    largest (hardest positives) or smallest (hardest negatives) distance. Ties: lowest index."""
    fill = float("-inf") if largest else float("inf")
    key = distance.detach().masked_fill(~mask, fill)
    order = torch.sort(key, dim=1, descending=largest, stable=True).indices
    ranks = torch.empty_like(order).scatter_(
        1, order, torch.arange(key.shape[1], device=key.device).expand_as(order).contiguous()
    )
    keep = (mask.sum(dim=1, keepdim=True) + 1) // 2
    return mask & (ranks < keep)
