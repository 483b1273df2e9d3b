"""Refreshing a stored gallery with psi (DMU forward adaptation, docs/methods.md, "Gallery-side
operations"): ``adapted = psi(old)`` with no image and no backbone pass.

For inference each Linear-BN pair of psi folds into one affine map
(``W' = diag(gamma / sqrt(var + eps)) W``, ``b' = (b - mean) * gamma / sqrt(var + eps) + beta``),
so a refresh is 4 matrix multiplies with bias + ReLU: :class:`FoldedPsi`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class FoldedPsi:
    """psi (``raycompat.models.ProjectionMLP``, eval mode) as ``[(W^T, b), ...]`` with BN folded."""

    def __init__(self, psi: nn.Module, device="cpu", dtype=torch.float32):
        layers = list(psi.net)
        self.weights: list[torch.Tensor] = []
        self.biases: list[torch.Tensor] = []
        i = 0
        while i < len(layers):
            lin = layers[i]
            if not isinstance(lin, nn.Linear):
                raise ValueError(f"unexpected psi layer {lin!r} at {i}")
            w = lin.weight.detach().double()
            b = (
                lin.bias.detach().double()
                if lin.bias is not None
                else torch.zeros(w.shape[0], dtype=torch.float64)
            )
            if i + 1 < len(layers) and isinstance(layers[i + 1], nn.BatchNorm1d):
                bn = layers[i + 1]
                scale = bn.weight.detach().double() / torch.sqrt(bn.running_var.double() + bn.eps)
                w = w * scale[:, None]
                b = (b - bn.running_mean.double()) * scale + bn.bias.detach().double()
                i += 1
            self.weights.append(w.t().contiguous().to(device=device, dtype=dtype))
            self.biases.append(b.to(device=device, dtype=dtype))
            i += 1
            if i < len(layers) and isinstance(layers[i], nn.ReLU):
                i += 1
        self.in_dim = self.weights[0].shape[0]
        self.out_dim = self.weights[-1].shape[1]
        self.device = torch.device(device)

    @property
    def flops_per_feature(self) -> int:
        """Multiply-adds x 2 of the matrix products (bias and ReLU not counted)."""
        return int(sum(2 * w.shape[0] * w.shape[1] for w in self.weights))

    @torch.inference_mode()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.weights) - 1
        for k, (w, b) in enumerate(zip(self.weights, self.biases, strict=False)):
            x = torch.addmm(b, x, w)
            if k < last:
                x.relu_()
        return x


def refresh(old: np.ndarray, psi: nn.Module, batch_size: int = 8192, device="cpu") -> np.ndarray:
    """``psi(old)`` for stored old features ``[n, D_old]`` -> float32 ``[n, D_new]``."""
    folded = FoldedPsi(psi.eval(), device=device)
    out = np.empty((old.shape[0], folded.out_dim), np.float32)
    for s in range(0, old.shape[0], batch_size):
        x = torch.from_numpy(np.ascontiguousarray(old[s : s + batch_size], dtype=np.float32)).to(
            device
        )
        out[s : s + batch_size] = folded(x).cpu().numpy()
    return out
