"""Small MLPs that map between embedding spaces.

- DMU forward-adaptive psi: 3 x [Linear-BN-ReLU] + Linear, hidden 1024 (METHODS.md 5).
- RM rho (head on phi_n) and psi_rev (new -> old reverse query transform) reuse the same
  building block with their own depth (METHODS.md 6).
"""
from __future__ import annotations

import torch
from torch import nn


class ProjectionMLP(nn.Module):
    """``num_blocks`` x [Linear-BN-ReLU] followed by a Linear to ``out_dim``."""

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int = 1024, num_blocks: int = 3,
                 role: str = "psi"):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_dim
        for _ in range(num_blocks):
            layers += [nn.Linear(width, hidden_dim), nn.BatchNorm1d(hidden_dim), nn.ReLU(inplace=True)]
            width = hidden_dim
        layers.append(nn.Linear(width, out_dim))
        self.net = nn.Sequential(*layers)
        self.in_dim, self.out_dim = in_dim, out_dim
        self.spec = dict(type="mlp", in_dim=in_dim, out_dim=out_dim, hidden_dim=hidden_dim,
                         num_blocks=num_blocks, role=role)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def PsiMLP(in_dim: int, out_dim: int, hidden_dim: int = 1024) -> ProjectionMLP:
    """DMU's forward-adaptive transformation psi: old feature space -> new feature space."""
    return ProjectionMLP(in_dim, out_dim, hidden_dim=hidden_dim, num_blocks=3, role="psi")
