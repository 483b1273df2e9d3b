"""psi gallery refresh with BatchNorm folded: the same features as the psi module."""

from __future__ import annotations

import numpy as np
import torch

from raycompat.models import PsiMLP
from raycompat.pipeline.psi_refresh import FoldedPsi, refresh


def test_folded_psi_equals_the_module():
    torch.manual_seed(0)
    psi = PsiMLP(12, 20, hidden_dim=32)
    with torch.no_grad():
        for m in psi.modules():
            if isinstance(m, torch.nn.BatchNorm1d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.3, 3.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    psi.eval()
    old = np.random.default_rng(0).standard_normal((50, 12)).astype(np.float32)
    with torch.no_grad():
        expected = psi(torch.from_numpy(old)).numpy()
    folded = FoldedPsi(psi)
    assert folded.flops_per_feature == 2 * (12 * 32 + 32 * 32 + 32 * 32 + 32 * 20)
    np.testing.assert_allclose(
        folded(torch.from_numpy(old)).numpy(), expected, rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(refresh(old, psi, batch_size=7), expected, rtol=1e-5, atol=1e-5)
