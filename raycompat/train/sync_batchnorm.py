"""Synchronized BatchNorm for multi-worker training (docs/architecture.md, training).

Under DDP every worker normalizes with the statistics of its own shard of the batch, so
2 workers would train a different model than 1 worker on the same global batch (and keep
different running statistics). :func:`synchronize_batchnorm` swaps every BatchNorm of a
model for a synchronized one that normalizes with the statistics of the global batch.

torch's ``nn.SyncBatchNorm`` refuses CPU input, and training here mostly runs on CPU with
gloo, so :class:`SyncBatchNorm` is a CPU-capable one: in training it all-reduces the
per-channel sum, sum of squares and count (differentiably), and it updates the running
statistics as plain BatchNorm would on the concatenated global batch. On CUDA, torch's own
``nn.SyncBatchNorm`` (timm's ``SyncBatchNormAct`` for timm's BatchNorm + activation) is
used. Parameter and buffer names are unchanged, so checkpoints and exported bundles load
into the plain modules.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from raycompat import torch_distributed

__all__ = ["SyncBatchNorm", "SyncBatchNormAct", "synchronize_batchnorm"]

#: the plain BatchNorm classes that are converted (their forward is plain BatchNorm)
_PLAIN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class _AllReduceSum(torch.autograd.Function):
    """Sum over workers, differentiable: the gradient is the sum of the workers' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _AllReduceSum.apply(grad)


class _LocalMoments(torch.autograd.Function):
    """Per-channel ``(sum x, sum x^2)`` of ``x`` (channel dim 1) in float64.

    Computed stably (the centred sum of squares of this worker plus ``n * mean^2``); the
    backward is the exact derivative ``g_sum + 2 x g_sq`` and keeps no tensor but ``x``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(x)
        dims = [0, *range(2, x.dim())]
        count = x.numel() // x.shape[1]
        total = x.sum(dims, dtype=torch.float64)
        mean = total / max(count, 1)
        shape = [1, -1] + [1] * (x.dim() - 2)
        centred = (x - mean.to(x.dtype).view(shape)).square().sum(dims, dtype=torch.float64)
        return total, centred + count * mean.square()

    @staticmethod
    def backward(ctx, g_sum: torch.Tensor, g_sq: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        shape = [1, -1] + [1] * (x.dim() - 2)
        g_sum, g_sq = g_sum.to(x.dtype).view(shape), g_sq.to(x.dtype).view(shape)
        return g_sum + 2 * x * g_sq


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of all workers, on any device (channel dim 1).

    Training with a process group of more than one worker: normalizes with the global
    mean and biased variance; the running statistics get the global mean and unbiased
    variance (global count), as plain BatchNorm on the concatenated batch would. Otherwise
    (eval mode, one worker, no process group): exactly plain BatchNorm."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or torch_distributed.world_size() == 1:
            return super().forward(x)  # plain BatchNorm (F.batch_norm)
        self._check_input_dim(x)
        if x.shape[1] != self.num_features:
            raise ValueError(f"expected {self.num_features} channels, got input {tuple(x.shape)}")
        local_sum, local_sq = _LocalMoments.apply(x)
        count = torch.tensor([x.numel() // x.shape[1]], dtype=torch.float64, device=x.device)
        stats = _AllReduceSum.apply(torch.cat([local_sum, local_sq, count]))
        channels = self.num_features
        total, squares, n = stats[:channels], stats[channels : 2 * channels], stats[-1]
        n_global = int(n.detach().item())
        if n_global <= 1:
            raise ValueError(
                "Expected more than 1 value per channel when training, got "
                f"{n_global} over all workers (input of this worker {tuple(x.shape)})"
            )
        mean = total / n
        var = (squares / n - mean.square()).clamp(min=0)  # biased: normalizes the batch
        self._update_running_stats(mean.detach(), var.detach(), n_global)
        scale = torch.rsqrt(var + self.eps)
        if self.weight is not None:
            scale = scale * self.weight
        shift = -mean * scale
        if self.bias is not None:
            shift = shift + self.bias
        shape = [1, -1] + [1] * (x.dim() - 2)
        return x * scale.to(x.dtype).view(shape) + shift.to(x.dtype).view(shape)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: int) -> None:
        """As torch's BatchNorm: momentum (``None``: cumulative average), unbiased variance."""
        if not self.track_running_stats or self.running_mean is None:
            return
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * (n / (n - 1))
        running_mean = (1 - factor) * self.running_mean.double() + factor * mean
        running_var = (1 - factor) * self.running_var.double() + factor * unbiased
        self.running_mean.copy_(running_mean)
        self.running_var.copy_(running_var)


class SyncBatchNormAct(SyncBatchNorm):
    """:class:`SyncBatchNorm` followed by the ``drop`` and ``act`` of a timm
    ``BatchNormAct2d`` (the layer timm backbones use)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(super().forward(x)))


def _timm_batchnorm_act(module: nn.Module, cuda: bool) -> type[_BatchNorm] | None:
    """The synchronized class for a timm ``BatchNormAct2d``; ``None`` for anything else
    (timm is not imported here: without it loaded, no module is a timm layer)."""
    if "timm" not in sys.modules:
        return None
    from timm.layers import BatchNormAct2d
    from timm.layers import SyncBatchNormAct as TimmSyncBatchNormAct

    if type(module) is not BatchNormAct2d:
        return None
    return TimmSyncBatchNormAct if cuda else SyncBatchNormAct


def _synchronized_class(module: _BatchNorm, device: torch.device) -> type[_BatchNorm] | None:
    """The synchronized class for ``module``; ``None`` when it is synchronized already."""
    if isinstance(module, (SyncBatchNorm, nn.SyncBatchNorm)):
        return None
    cuda = device.type == "cuda"
    timm_class = _timm_batchnorm_act(module, cuda)
    if timm_class is not None:
        return timm_class
    if type(module) in _PLAIN:
        return nn.SyncBatchNorm if cuda else SyncBatchNorm
    # another forward (e.g. timm's SplitBatchNorm2d) would be silently replaced: refuse
    raise TypeError(
        f"cannot synchronize {type(module).__name__}: only {[c.__name__ for c in _PLAIN]} "
        "and timm's BatchNormAct2d are converted"
    )


def _convert(module: _BatchNorm, cls: type[_BatchNorm]) -> _BatchNorm:
    """A ``cls`` holding ``module``'s parameters, buffers, children, settings and mode."""
    out = cls(
        module.num_features,
        eps=module.eps,
        momentum=module.momentum,
        affine=module.affine,
        track_running_stats=module.track_running_stats,
    )
    # the very same Parameter and buffer objects: values, device, requires_grad kept
    for name in ("weight", "bias"):
        setattr(out, name, getattr(module, name))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        out.register_buffer(name, getattr(module, name))
    for name, child in module.named_children():  # BatchNormAct2d: drop, act
        out.add_module(name, child)
    out.training = module.training
    return out


def synchronize_batchnorm(module: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """``module`` with every BatchNorm swapped for a synchronized one (in place; the
    returned module differs only when ``module`` itself is a BatchNorm): torch's
    ``nn.SyncBatchNorm`` on CUDA, :class:`SyncBatchNorm` otherwise. Weights, running
    statistics, settings, ``requires_grad`` and train/eval mode are kept; state_dict keys
    are unchanged. Modules already synchronized are left alone."""
    device = torch.device(device)
    if isinstance(module, torch.jit.ScriptModule):  # a scripted model is left as it is
        return module
    if isinstance(module, _BatchNorm):
        cls = _synchronized_class(module, device)
        if cls is not None:
            module = _convert(module, cls)
    for name, child in list(module.named_children()):
        converted = synchronize_batchnorm(child, device)
        if converted is not child:
            module.add_module(name, converted)
    return module
