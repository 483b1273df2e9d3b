"""BT^2's basis transformation (Zhou et al., "BT^2: Backward-compatible Training with Basis
Transformation", ICCV 2023; docs/methods.md, Field methods, bt2).

The backbone emits ``z`` of ``D_n + D_o`` dims; with ``A`` extra dims and a scale ``C``:

- ``u = normalize(fc3(relu(z)))`` (``fc3``: ``D_n + D_o -> D_o``, with bias);
- ``v = normalize(z[:, :D_n])``, the new model's own feature (its classifier reads it);
- ``m = [normalize(u[:, :A]), Q1(C v)]`` (``Q1``: ``D_n x D_n`` orthogonal);
- ``b = Q2(m[:, :D_o])`` (``Q2``: ``D_o x D_o`` orthogonal), the backward-compatible part, and
  ``e = m[:, D_o:]``, the ``D_n + A - D_o`` extra dims;
- the deployed embedding ``concat(b, e)`` (``D_n + A`` dims), whose first ``D_o`` dims meet
  ``phi_o``.

``BasisTransform`` holds ``fc3``, ``Q1``, ``Q2`` (``torch.nn.utils.parametrizations.orthogonal``);
``BasisEmbedder`` is the deployed embedder of a bundle: the backbone embedder, then the transform.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import orthogonal


def check_basis_dims(new_dim: int, old_dim: int, extra_dim: int) -> None:
    """``1 <= A <= D_o`` (``u`` has ``D_o`` dims) and ``D_n + A >= D_o`` (``b`` has ``D_o``)."""
    if not 0 < extra_dim <= old_dim:
        raise ValueError(f"bt2: extra dims A = {extra_dim} must be in [1, D_o = {old_dim}]")
    if new_dim + extra_dim < old_dim:
        raise ValueError(
            f"bt2: D_n + A = {new_dim} + {extra_dim} must be >= D_o = {old_dim} "
            "(the compatible part has D_o dims)"
        )


class BasisTransform(nn.Module):
    """``z -> {v, b, e, out}`` as in the module docstring."""

    def __init__(self, new_dim: int, old_dim: int, extra_dim: int = 32, scale: float = 2.0):
        super().__init__()
        check_basis_dims(new_dim, old_dim, extra_dim)
        self.new_dim, self.old_dim, self.extra_dim = new_dim, old_dim, extra_dim
        self.scale = float(scale)
        self.fc3 = nn.Linear(new_dim + old_dim, old_dim)
        self.q1 = orthogonal(nn.Linear(new_dim, new_dim, bias=False))
        self.q2 = orthogonal(nn.Linear(old_dim, old_dim, bias=False))
        self.in_dim, self.out_dim = new_dim + old_dim, new_dim + extra_dim
        self.spec = dict(new_dim=new_dim, old_dim=old_dim, extra_dim=extra_dim, scale=self.scale)

    def parts(self, z: torch.Tensor) -> dict[str, torch.Tensor]:
        """``v``, ``b``, ``e`` and the deployed ``out = concat(b, e)`` of the raw ``z``."""
        u = F.normalize(self.fc3(F.relu(z)), dim=1)
        v = F.normalize(z[:, : self.new_dim], dim=1)
        m = torch.cat([F.normalize(u[:, : self.extra_dim], dim=1), self.q1(self.scale * v)], 1)
        b = self.q2(m[:, : self.old_dim])
        e = m[:, self.old_dim :]
        return {"v": v, "b": b, "e": e, "out": torch.cat([b, e], dim=1)}

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.parts(z)["out"]


class BasisEmbedder(nn.Module):
    """The deployed BT^2 embedder: ``base`` (an embedder emitting ``z``), then ``basis``.
    ``embed_dim`` = ``D_n + A``; bundles rebuild it from ``spec`` (module type ``bt2``)."""

    def __init__(self, base: nn.Module, basis: BasisTransform):
        super().__init__()
        if base.embed_dim != basis.in_dim:
            raise ValueError(
                f"bt2: the backbone emits {base.embed_dim} dims, the transform takes "
                f"D_n + D_o = {basis.in_dim}"
            )
        self.base, self.basis = base, basis
        self.embed_dim = basis.out_dim
        self.spec = dict(
            type="bt2",
            embed_dim=basis.out_dim,
            in_chans=int(getattr(base, "spec", {}).get("in_chans", 1)),
            base=getattr(base, "spec", {}),
            basis=basis.spec,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.basis(self.base(x))

    @torch.no_grad()
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """L2-normalised retrieval embedding."""
        return F.normalize(self.forward(x), dim=-1)
