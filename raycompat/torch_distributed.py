"""torch.distributed helpers that also work in a single process (world size 1)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over workers, in place and returned (no-op on one worker)."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate ``tensor`` from every worker along dim 0, in rank order.

    The local slice is the caller's own tensor, so gradient flows to it; the other workers'
    slices are constants here (they get their gradient on their own worker). Equal batch
    sizes per worker are required.
    """
    if not is_distributed():
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world_size())]
    dist.all_gather(parts, tensor.detach().contiguous())
    parts[rank()] = tensor
    return torch.cat(parts, dim=0)


def shard_indices(n: int) -> np.ndarray:
    """This worker's indices of ``range(n)``: a strided split with no padding, so that a
    per-epoch pass visits every item exactly once across workers."""
    return np.arange(rank(), n, world_size())


def all_gather_strings(value: str) -> list[str]:
    """``value`` from every worker, in rank order (``[value]`` on one worker)."""
    if not is_distributed():
        return [value]
    out: list = [None] * world_size()
    dist.all_gather_object(out, value)
    return [str(v) for v in out]


def barrier() -> None:
    if is_distributed():
        dist.barrier()
