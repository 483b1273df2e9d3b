"""Small MLPs that map between embedding spaces.

- DMU forward-adaptive psi: 3 x [Linear-BN-ReLU] + Linear, hidden 1024 (docs/methods.md,
  Training objectives).
- RM rho (head on phi_n) and psi_rev (new -> old reverse query transform) reuse the same
  building block with their own depth (docs/methods.md, Training objectives).
- FCT's transformation h (old -> new, trained on frozen models; docs/methods.md, Field methods):
  ``ForwardTransformation``.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class ProjectionMLP(nn.Module):
    """``num_blocks`` x [Linear-BN-ReLU] followed by a Linear to ``out_dim``."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        hidden_dim: int = 1024,
        num_blocks: int = 3,
        role: str = "psi",
    ):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_dim
        for _ in range(num_blocks):
            layers += [
                nn.Linear(width, hidden_dim),
                nn.BatchNorm1d(hidden_dim),
                nn.ReLU(inplace=True),
            ]
            width = hidden_dim
        layers.append(nn.Linear(width, out_dim))
        self.net = nn.Sequential(*layers)
        self.in_dim, self.out_dim = in_dim, out_dim
        self.spec = dict(
            type="mlp",
            in_dim=in_dim,
            out_dim=out_dim,
            hidden_dim=hidden_dim,
            num_blocks=num_blocks,
            role=role,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def linear_bn_relu(in_dim: int, out_dim: int) -> list[nn.Module]:
    """One [Linear-BN-ReLU] block: the math of a 1x1 conv-BN-ReLU on a ``[B, D, 1, 1]`` map."""
    return [nn.Linear(in_dim, out_dim), nn.BatchNorm1d(out_dim), nn.ReLU(inplace=True)]


class ForwardTransformation(nn.Module):
    """FCT's ``h`` without side information (Ramanujan et al., CVPR 2022): ``p1`` maps the old
    feature ``D_o -> 2 D_o -> 2 D_n`` and the ``mixer`` maps ``2 D_n -> H -> H -> D_n``, every
    layer Linear-BN-ReLU except the last (a plain Linear). The released code's 1x1 convolutions
    on ``[B, D, 1, 1]`` are these Linear layers (the same math)."""

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int = 2048):
        super().__init__()
        self.p1 = nn.Sequential(
            *linear_bn_relu(in_dim, 2 * in_dim), *linear_bn_relu(2 * in_dim, 2 * out_dim)
        )
        self.mixer = nn.Sequential(
            *linear_bn_relu(2 * out_dim, hidden_dim),
            *linear_bn_relu(hidden_dim, hidden_dim),
            nn.Linear(hidden_dim, out_dim),
        )
        self.in_dim, self.out_dim = in_dim, out_dim
        self.spec = dict(type="fct", in_dim=in_dim, out_dim=out_dim, hidden_dim=hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mixer(self.p1(x))


def PsiMLP(in_dim: int, out_dim: int, hidden_dim: int = 1024) -> ProjectionMLP:
    """DMU's forward-adaptive transformation psi: old feature space -> new feature space."""
    return ProjectionMLP(in_dim, out_dim, hidden_dim=hidden_dim, num_blocks=3, role="psi")


class FeatureMap:
    """A feature-space module (psi, rho, psi_rev) applied to stored features, outside training:
    eval mode, no gradients, computed in float64 and returned as float32.

    float64 makes a row's output independent of the rows computed with it in practice: BLAS
    kernels sum in orders that depend on the batch shape, and in float64 those differences
    stay ~2^-29 below float32's resolution, so the float32 result is the same whether the
    row went through the simulator's batch of 8192 or a request of one query (the live index
    and the simulator then score bit-identical vectors).

    ``exact=False`` computes in float32, about twice as fast, for a first pass whose results
    are scored again with the exact map (a store search's candidates)."""

    def __init__(self, module: nn.Module, batch_size: int = 8192, exact: bool = True):
        import copy

        self.dtype = np.float64 if exact else np.float32
        self.module = copy.deepcopy(module).cpu().eval()
        self.module = self.module.double() if exact else self.module.float()
        self.in_dim = getattr(module, "in_dim", None)
        self.out_dim = getattr(module, "out_dim", None)
        self.batch_size = int(batch_size)

    def __call__(self, x) -> np.ndarray:
        x = np.asarray(x)
        if x.ndim != 2 or (self.in_dim is not None and x.shape[1] != self.in_dim):
            raise ValueError(f"expected [n, {self.in_dim}] features, got shape {x.shape}")
        out = []
        with torch.no_grad():
            for s in range(0, x.shape[0], self.batch_size):
                chunk = torch.from_numpy(
                    np.ascontiguousarray(x[s : s + self.batch_size], dtype=self.dtype)
                )
                out.append(self.module(chunk).numpy().astype(np.float32))
        if not out:
            return np.zeros((0, self.out_dim or 0), np.float32)
        return np.concatenate(out)
